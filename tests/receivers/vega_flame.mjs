// Renders the flame graph of packaging/opensearch/firn-dashboards.ndjson with Vega 5 (the
// library OpenSearch Dashboards runs Vega visualizations with), fed with stack documents
// the OpenSearch stand-in received instead of its OpenSearch query. Prints a JSON summary;
// writes the SVG when given a third path.
//   node vega_flame.mjs DASHBOARDS.ndjson STACK_DOCS.json [OUT.svg]
import fs from "fs";
import * as vega from "vega";

const [ndjson, docsPath, svgPath] = process.argv.slice(2);
const objects = fs.readFileSync(ndjson, "utf8").split("\n").filter(Boolean).map(JSON.parse);
const vis = objects
  .filter(o => o.type === "visualization")
  .map(o => JSON.parse(o.attributes.visState))
  .find(v => v.type === "vega");
if (!vis) throw new Error("no Vega visualization in " + ndjson);
const spec = JSON.parse(vis.params.spec);
const stacks = spec.data.find(d => d.name === "stacks");
if (!stacks.url || stacks.url.index !== "firn-profiles-*") throw new Error("the stacks query changed");
delete stacks.url;
delete stacks.format;
const docs = JSON.parse(fs.readFileSync(docsPath, "utf8"));
stacks.values = docs.map(d => ({ _source: { frames: d.frames, samples: d.samples } }));
const view = new vega.View(vega.parse(spec), { renderer: "none" });
const svg = await view.toSVG();
if (svgPath) fs.writeFileSync(svgPath, svg);
const flame = view.data("flame");
const names = [...new Set(flame.map(n => n.name))];
const root = flame.find(n => n.id === "all");
console.log(JSON.stringify({
  nodes: flame.length,
  names,
  root_share: root ? root.share : null,
  samples: docs.reduce((a, d) => a + d.samples, 0),
  svg_bytes: svg.length,
  svg_text: names.filter(n => svg.includes(">" + n + "<")),
}));

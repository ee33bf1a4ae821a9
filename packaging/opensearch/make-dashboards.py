#!/usr/bin/env python3
"""Writes firn-dashboards.ndjson, the OpenSearch Dashboards saved objects for firn's
OpenSearch sink: the index pattern, CPU per process name and per container over time
(line charts of cpu_ns), a flame graph (Vega, from flamegraph.vega.json) and a search of
stack documents, and a dashboard of them. Run it after changing either file; the tests
check the result against the index template firn installs."""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
IP = "firn-profiles"


def ref():
    return [{"id": IP, "name": "kibanaSavedObjectMeta.searchSourceJSON.index", "type": "index-pattern"}]


def source(q, with_index=True):
    s = {"query": {"query": q, "language": "kuery"}, "filter": []}
    if with_index:
        s["indexRefName"] = "kibanaSavedObjectMeta.searchSourceJSON.index"
    return json.dumps(s)


def line(id_, title, split):
    vis = {
        "title": title, "type": "line",
        "aggs": [
            {"id": "1", "enabled": True, "type": "sum", "schema": "metric",
             "params": {"field": "cpu_ns", "customLabel": "CPU ns"}},
            {"id": "2", "enabled": True, "type": "date_histogram", "schema": "segment",
             "params": {"field": "@timestamp", "interval": "auto", "min_doc_count": 1, "extended_bounds": {},
                        "drop_partials": False, "scaleMetricValues": False}},
            {"id": "3", "enabled": True, "type": "terms", "schema": "group",
             "params": {"field": split, "size": 10, "order": "desc", "orderBy": "1", "otherBucket": True,
                        "otherBucketLabel": "other", "missingBucket": False}},
        ],
        "params": {
            "type": "line", "addTooltip": True, "addLegend": True, "legendPosition": "right", "times": [],
            "addTimeMarker": False, "grid": {"categoryLines": False},
            "categoryAxes": [{"id": "CategoryAxis-1", "type": "category", "position": "bottom", "show": True,
                              "style": {}, "scale": {"type": "linear"},
                              "labels": {"show": True, "filter": True, "truncate": 100}, "title": {}}],
            "valueAxes": [{"id": "ValueAxis-1", "name": "LeftAxis-1", "type": "value", "position": "left",
                           "show": True, "style": {}, "scale": {"type": "linear", "mode": "normal"},
                           "labels": {"show": True, "rotate": 0, "filter": False, "truncate": 100},
                           "title": {"text": "CPU ns"}}],
            "seriesParams": [{"show": True, "type": "line", "mode": "normal", "data": {"label": "CPU ns", "id": "1"},
                              "valueAxis": "ValueAxis-1", "drawLinesBetweenPoints": True, "lineWidth": 2,
                              "interpolate": "linear", "showCircles": True}],
            "labels": {}, "thresholdLine": {"show": False, "value": 10, "width": 1, "style": "full",
                                            "color": "#E7664C"},
        },
    }
    return {"id": id_, "type": "visualization", "migrationVersion": {"visualization": "7.10.0"}, "version": "1",
            "attributes": {"title": title, "description": "Sum of cpu_ns of firn's profile documents, per " + split,
                           "visState": json.dumps(vis), "uiStateJSON": "{}", "version": 1,
                           "kibanaSavedObjectMeta": {"searchSourceJSON": source("doc_type:profile")}},
            "references": ref()}


def flame():
    spec = (HERE / "flamegraph.vega.json").read_text()
    vis = {"title": "firn: flame graph", "type": "vega", "aggs": [], "params": {"spec": spec}}
    return {"id": "firn-flamegraph", "type": "visualization", "migrationVersion": {"visualization": "7.10.0"},
            "version": "1",
            "attributes": {"title": "firn: flame graph",
                           "description": "Stack documents in the time range, query and filters, as a flame graph",
                           "visState": json.dumps(vis), "uiStateJSON": "{}", "version": 1,
                           "kibanaSavedObjectMeta": {"searchSourceJSON": source("", with_index=False)}},
            "references": []}


def main():
    objs = [
        {"id": IP, "type": "index-pattern", "migrationVersion": {"index-pattern": "7.6.0"}, "version": "1",
         "attributes": {"title": "firn-profiles-*", "timeFieldName": "@timestamp", "fields": "[]"},
         "references": []},
        line("firn-cpu-by-comm", "firn: CPU per process name", "comm"),
        line("firn-cpu-by-container", "firn: CPU per container", "container_id"),
        flame(),
        {"id": "firn-stacks", "type": "search", "migrationVersion": {"search": "7.9.3"}, "version": "1",
         "attributes": {"title": "firn: stacks", "description": "Stack documents, heaviest first; search frames:name",
                        "columns": ["leaf", "samples", "comm", "executable", "container_id", "frames"],
                        "sort": [["samples", "desc"]], "version": 1,
                        "kibanaSavedObjectMeta": {"searchSourceJSON": source("doc_type:stack")}},
         "references": ref()},
    ]
    panels, refs = [], []
    layout = [("firn-cpu-by-comm", "visualization", 0, 0, 24, 15),
              ("firn-cpu-by-container", "visualization", 24, 0, 24, 15),
              ("firn-flamegraph", "visualization", 0, 15, 48, 20),
              ("firn-stacks", "search", 0, 35, 48, 15)]
    for i, (pid, ty, x, y, w, h) in enumerate(layout):
        panels.append({"version": "2.11.0", "gridData": {"x": x, "y": y, "w": w, "h": h, "i": str(i + 1)},
                       "panelIndex": str(i + 1), "embeddableConfig": {}, "panelRefName": f"panel_{i}"})
        refs.append({"name": f"panel_{i}", "type": ty, "id": pid})
    objs.append({"id": "firn-overview", "type": "dashboard", "migrationVersion": {"dashboard": "7.9.3"},
                 "version": "1",
                 "attributes": {"title": "firn: CPU profiles",
                                "description": "CPU over time from firn's profile documents; its stacks as a flame "
                                               "graph and a search",
                                "panelsJSON": json.dumps(panels),
                                "optionsJSON": json.dumps({"hidePanelTitles": False, "useMargins": True}),
                                "timeRestore": False, "version": 1,
                                "kibanaSavedObjectMeta": {"searchSourceJSON": source("", with_index=False)}},
                 "references": refs})
    with open(HERE / "firn-dashboards.ndjson", "w") as f:
        for o in objs:
            f.write(json.dumps(o, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()

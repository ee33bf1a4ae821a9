#!/usr/bin/env python3
"""Structure gates run by tests/run.sh before anything is built:

1. No hand-written source file is over 600 lines (generated and vendored files, lock
   files and fuzz inputs are not hand-written).
2. No crate declares a dependency its code never names (what `cargo machete` checks:
   each dependency's crate name must appear in the crate's sources).
3. The enricher's layers: `model` and `metrics` import no other module of the crate,
   and no output sink imports another sink (they share `output/` itself, `delivery`,
   `grpc`, `layout` and `group`).

Exits 1 with every violation listed. `python3 tests/gates.py` runs it alone.
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 600
SOURCE = {".rs", ".c", ".h", ".py", ".sh", ".js", ".mjs", ".html", ".css", ".yaml", ".toml"}
NOT_HAND_WRITTEN = [
    "sampler-bpf/src/bpf/vmlinux.h",  # bpftool's dump of the kernel's BTF
    "fuzz/seeds/",
    "fuzz/regressions/",
]
# Dependencies a crate needs without naming them in its code.
USED_WITHOUT_NAME = {
    # The skeleton libbpf-cargo generates (included from OUT_DIR) is libbpf-rs code.
    ("sampler-bpf", "libbpf-rs"),
}
SINKS = ["local", "http", "otlp", "parca", "opensearch"]


def files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / f for f in out.stdout.split()]


def long_files():
    bad = []
    for p in files():
        rel = p.relative_to(ROOT).as_posix()
        if p.suffix not in SOURCE or any(rel.startswith(x) for x in NOT_HAND_WRITTEN):
            continue
        if not p.is_file():
            continue
        n = sum(1 for _ in p.open(errors="replace"))
        if n > MAX_LINES:
            bad.append(f"{rel}: {n} lines (at most {MAX_LINES})")
    return bad


def dependencies(manifest):
    """The dependency keys of every [*dependencies] table of a Cargo.toml."""
    deps, section = [], None
    for line in manifest.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
            continue
        if section and section.endswith("dependencies") and "=" in line and not line.startswith("#"):
            deps.append(line.split("=", 1)[0].strip().removesuffix(".workspace"))
    return deps


def unused_dependencies():
    bad = []
    crates = [p.parent for p in ROOT.glob("*/Cargo.toml")] + [ROOT / "fuzz"]
    for crate in sorted(set(crates)):
        manifest = crate / "Cargo.toml"
        if not manifest.exists():
            continue
        text = "\n".join(
            p.read_text(errors="replace")
            for p in crate.rglob("*.rs")
            if "target" not in p.relative_to(crate).parts
        )
        for dep in dependencies(manifest):
            if (crate.name, dep) in USED_WITHOUT_NAME:
                continue
            ident = dep.replace("-", "_")
            if not re.search(rf"\b{re.escape(ident)}\b", text):
                bad.append(f"{crate.name}/Cargo.toml: {dep} is never named in the crate's code")
    return bad


def imports(path):
    """The crate modules a source file names: `crate::x` and, inside output/, sibling
    modules by `super::x`."""
    text = path.read_text()
    names = set(re.findall(r"\bcrate::([a-z_]+)", text))
    return names, text


def layers():
    bad = []
    src = ROOT / "enricher" / "src"
    for leaf in ["model.rs", "metrics.rs"]:
        names, _ = imports(src / leaf)
        if names:
            bad.append(f"enricher/src/{leaf} imports {sorted(names)}: it must import no stage")
    out = src / "output"
    for sink in SINKS:
        paths = [out / f"{sink}.rs"] if (out / f"{sink}.rs").exists() else list((out / sink).rglob("*.rs"))
        for p in paths:
            text = p.read_text()
            for other in SINKS:
                if other == sink:
                    continue
                if re.search(rf"\b(crate::output::|super::){other}\b", text):
                    bad.append(f"{p.relative_to(ROOT)}: the {sink} sink imports the {other} sink")
    return bad


def main():
    problems = long_files() + unused_dependencies() + layers()
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} structure gate(s) failed", file=sys.stderr)
        return 1
    print("structure gates: files within 600 lines, no unused dependency, layers kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())

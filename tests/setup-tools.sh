#!/usr/bin/env bash
# Installs the tools the end-to-end tests read firn's output with (idempotent): a Python
# venv (target/test-venv) with the OpenTelemetry project's bindings and grpcio (the OTLP
# receiver) and selenium (the web view tests, with Debian's chromium and
# chromium-driver); Parca's published client types with a Node gRPC server
# (tests/receivers/node_modules). Run by tests/run.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/packaging/install-deps.sh"
command -v npm >/dev/null || install_missing nodejs npm
python3 -c 'import venv, ensurepip' 2>/dev/null || install_missing python3-venv
install_missing chromium chromium-driver
venv="$root/target/test-venv"
req="$root/tests/requirements.txt"
if ! cmp -s "$req" "$venv/.requirements" 2>/dev/null; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check -r "$req"
    cp "$req" "$venv/.requirements"
fi
cd "$root/tests/receivers"
if ! cmp -s package-lock.json node_modules/.firn-lock 2>/dev/null; then
    npm ci --no-audit --no-fund --loglevel=error
    cp package-lock.json node_modules/.firn-lock
fi

#!/usr/bin/env bash
# Rebuilds the seed corpus (fuzz/seeds/<target>/seed-*) from real traffic and files:
# the sampler and enricher run with fuzz/capture.py relaying between them while a
# workload runs; the client's bytes seed sampler_connection, the batches pushed to it
# seed enricher_batch; real binaries seed symbolize_elf. Needs root and release builds.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT
cargo build --release --locked --workspace --bins
cargo build --release --locked -p firn-schema --example extract_batches
clang -O2 -g -fno-omit-frame-pointer -pthread -o "$tmp/busy" tests/workloads/busy.c

target/release/firn-sampler --socket "$tmp/s.sock" --frequency 99 --round 1 2>"$tmp/sampler.log" &
for _ in $(seq 100); do [ -S "$tmp/s.sock" ] && break; sleep 0.1; done
python3 fuzz/capture.py "$tmp/s.sock" "$tmp/relay.sock" "$tmp/cap" &
for _ in $(seq 100); do [ -S "$tmp/relay.sock" ] && break; sleep 0.1; done
mkdir "$tmp/out"
target/release/firn-enricher --allow-root --socket "$tmp/relay.sock" --output-dir "$tmp/out" \
    --http-address 127.0.0.1:0 2>"$tmp/enricher.log" &
enricher=$!
"$tmp/busy" 4 >/dev/null
sleep 2
kill "$enricher"; wait "$enricher" || true

s=fuzz/seeds
rm -f $s/*/seed-*
# The session now carries unwind table chunks (up to 256 KiB each): its first 320 KiB
# hold the handshake, subscription, broker requests and at least one whole chunk, and
# keep each fuzzing run fast.
head -c 327680 "$tmp/cap/conn-1.c2s" > $s/sampler_connection/seed-enricher-session
[ -f "$tmp/cap/conn-2.c2s" ] && cp "$tmp/cap/conn-2.c2s" $s/sampler_connection/seed-broker-channel
target/release/examples/extract_batches "$tmp/cap/conn-1.s2c" "$tmp/batches"
# A few batches of different sizes are enough: libFuzzer mutates from there.
ls -S "$tmp/batches" | awk 'NR<=3 || NR%5==0' | head -8 | while read -r f; do cp "$tmp/batches/$f" $s/enricher_batch/; done

cp "$tmp/busy" $s/symbolize_elf/seed-busy-debug
strip -o $s/symbolize_elf/seed-busy-stripped "$tmp/busy"
clang -O1 -o $s/symbolize_elf/seed-tiny -x c - <<'C'
int main(void) { return 0; }
C
strip $s/symbolize_elf/seed-tiny

cat > $s/relabel_config/seed-readme <<'Y'
output_dir: /var/lib/firn/profiles
profile_by: process
relabel_configs:
  - {source_labels: [__meta_process_comm], regex: 'kworker/.*', action: drop}
  - {source_labels: [__meta_process_pid], target_label: pid}
  - {source_labels: [__meta_process_executable_name], target_label: executable}
  - {source_labels: [__meta_systemd_unit], target_label: systemd_unit}
external_labels: {cluster: prod-eu}
Y
cat > $s/relabel_config/seed-actions <<'Y'
relabel_configs:
  - {source_labels: [__meta_process_executable, __meta_process_comm], separator: ';', regex: '(.*)/(.*);(b.*)', target_label: x, replacement: '${2}-$3'}
  - {source_labels: [__meta_process_pid], modulus: 4, target_label: shard, action: hashmod}
  - {regex: '__meta_process_(.+)', replacement: 'p_$1', action: labelmap}
  - {regex: 'p_comm', action: labeldrop}
  - {regex: 'p_.*|node|x|shard', action: labelkeep}
  - {source_labels: [shard], regex: '[0-3]', action: keep}
  - {source_labels: [x], target_label: y, action: lowercase}
  - {source_labels: [x], target_label: z, action: uppercase}
  - {source_labels: [x, y], regex: 'a|b', action: keepequal, target_label: x}
retention_size: 1GiB
retention_age: 7d
min_free: 100MiB
Y
printf '0::/system.slice/nginx.service\n' > $s/cgroup_path/seed-systemd-v2
printf '0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2c3d4e_5f6a_7b8c_9d0e_1f2a3b4c5d6e.slice/cri-containerd-4f1a6bb2c0e1d9f8a7b6c5d4e3f2a1b0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f4.scope\n' > $s/cgroup_path/seed-k8s-containerd
printf '12:pids:/docker/4f1a6bb2c0e1d9f8a7b6c5d4e3f2a1b0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f4\n11:memory:/docker/4f1a6bb2c0e1d9f8a7b6c5d4e3f2a1b0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f4\n1:name=systemd:/docker/4f1a6bb2c0e1d9f8a7b6c5d4e3f2a1b0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f4\n0::/\n' > $s/cgroup_path/seed-docker-v1
printf '0::/user.slice/user-1000.slice/user@1000.service/app.slice/app-gnome\\x2dterminal\\x2dserver.scope\n' > $s/cgroup_path/seed-user-escaped
printf '0::/machine.slice/libpod-4f1a6bb2c0e1d9f8a7b6c5d4e3f2a1b0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f4.scope/container\n' > $s/cgroup_path/seed-podman
cat /proc/self/cgroup > $s/cgroup_path/seed-this-machine
ls -l $s/*

# The unwind table builder reads the same binaries; the row checker starts from rows of
# every kind (first byte: first row index, then an optional previous pc).
cp $s/symbolize_elf/seed-* $s/unwind_table_build/
python3 - "$s/unwind_rows" <<'PY'
import struct, sys
d = sys.argv[1] + '/'
def row(pc, off, cfa, rbp, r8): return struct.pack('<IHBb', pc, off, cfa | rbp << 4, r8)
open(d + 'seed-valid', 'wb').write(bytes(5) + row(0x1000, 8, 1, 0, 0) + row(0x1001, 16, 1, 1, -2)
    + row(0x1004, 16, 2, 1, -2) + row(0x1010, 11, 3, 0, 0) + row(0x1020, 0, 4, 0, 0)
    + row(0x1030, 0, 6, 0, 0) + row(0x1040, 0, 0, 0, 0))
open(d + 'seed-continued', 'wb').write(bytes([3, 1, 0x10, 0, 0]) + row(0x2000, 8, 1, 0, 0) + row(0x2008, 24, 1, 1, -3))
open(d + 'seed-unsorted', 'wb').write(bytes(5) + row(0x20, 8, 1, 0, 0) + row(0x10, 8, 1, 0, 0))
PY

# CFI programs (cfi_program): factor bytes, the CIE's program after its length, then
# length-prefixed FDE programs: a frame set up and torn down, remember/restore around an
# early return, a PLT expression, an rbp save restored.
mkdir -p $s/cfi_program
python3 - "$s/cfi_program" <<'PY'
import sys
d = sys.argv[1] + '/'
cie = bytes([0x0c, 7, 8, 0x90, 1])
def seed(name, *fdes):
    out = bytes([0, 0, len(cie)]) + cie
    for f in fdes: out += bytes([len(f)]) + bytes(f)
    open(d + 'seed-' + name, 'wb').write(out)
seed('frame', [0x41, 0x0e, 16, 0x86, 2, 0x43, 0x0d, 6, 0x4a, 0x0c, 7, 8])
seed('remember', [0x41, 0x0e, 16, 0x86, 2, 0x44, 0x0a, 0x0e, 8, 0xc6, 0x41, 0x0b, 0x42, 0x0e, 8])
seed('plt', [0x0f, 11, 0x77, 8, 0x80, 0, 0x3f, 0x1a, 0x3b, 0x2a, 0x33, 0x24, 0x22], [0x02, 200, 0x12, 7, 0x7e, 0x11, 6, 0x7d])
PY
 a small shared object with the symbols and sizes of a 3.10 (its
# version comes from the name the target gives) and one with a 3.13 Py_Version and a
# _PyRuntime that starts with the debug offsets' cookie.
mkdir -p $s/python_interpreter $s/python_lines
cc -shared -fPIC -O1 -o $s/python_interpreter/seed-310 -x c - <<'C'
char _PyRuntime[672] = {1};
long PyCode_Type[52] = {0, 0, 0, 0, 176};
long PyBytes_Type[52] = {0, 0, 0, 0, 33};
long PyUnicode_Type[52] = {0, 0, 0, 0, 80};
void _PyEval_EvalFrameDefault(void) {}
C
cc -shared -fPIC -O1 -o $s/python_interpreter/seed-313 -x c - <<'C'
const unsigned Py_Version = 0x030d00f0;
struct { char cookie[8]; unsigned long v[70]; } _PyRuntime = {"xdebugpy", {0x030d00f0}};
long PyCode_Type[52] = {0, 0, 0, 0, 200};
long PyBytes_Type[52] = {0, 0, 0, 0, 33};
long PyUnicode_Type[52] = {0, 0, 0, 0, 80};
void _PyEval_EvalFrameDefault(void) {}
C
strip $s/python_interpreter/seed-*
# Line tables: 8 bytes (first line, byte offset), then a 3.10 pair table and a 3.11+
# location table that CPython wrote.
python3 - "$s/python_lines" <<'PY'
import struct, sys
d = sys.argv[1] + '/'
def f(a, b=1):
    x = [i * b for i in range(a)]
    for y in x:
        if y > 3:
            return y
    return None
co = f.__code__
open(d + 'seed-cpython', 'wb').write(struct.pack('<iI', co.co_firstlineno, 6) + co.co_linetable)
open(d + 'seed-pairs', 'wb').write(struct.pack('<iI', 1, 4) + bytes([4, 1, 4, 1, 2, 0x80, 6, 2]))
PY
# An interpreter record as the enricher makes it from pyenv's 3.12.1 (schema
# python_record: 8 kind bytes, 9 words, 23 offsets, 2 reserved bytes).
mkdir -p $s/python_record
python3 - "$s/python_record" <<'PY'
import struct, sys
head = bytes([1, 12, 1, 1, 2, 3, 0, 0])
words = [0, 0x643340, 0x549e80, 0x563c20, 0x548840, 0x10bdc0, 0x11882d, 0x10ba24, 0x10bdb0]
offs = [48, 72, 8, 136, 56, 0, 8, 0, 56, 70, 192, 200, 112, 128, 136, 68, 8, 24, 32, 16, 40, 16, 32]
open(sys.argv[1] + '/seed-3.12', 'wb').write(head + struct.pack('<9Q', *words) + struct.pack('<23H', *offs) + bytes(2))
PY

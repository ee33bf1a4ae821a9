#!/usr/bin/env bash
# Builds the container image localhost/firn:<version> with buildah, FROM scratch: the two
# release binaries, the shared libraries they load (as ldd lists them), CA roots for
# upload, and passwd/group entries for the uids the pod uses. No base image is pulled:
# nothing in the image but what firn runs.
#
#   packaging/image.sh            # builds target/release first if a binary is missing
#   FIRN_BIN_DIR=dir packaging/image.sh [--tag localhost/firn:dev]
#
# Push it with podman or skopeo, e.g.
#   podman push localhost/firn:0.1.0 registry.example.com/firn:0.1.0
#   skopeo copy containers-storage:localhost/firn:0.1.0 docker://registry.example.com/firn:0.1.0
set -euo pipefail
cd "$(dirname "$0")/.."

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
tag="localhost/firn:$version"
while [ $# -gt 0 ]; do
    case "$1" in
        --tag) tag="$2"; shift 2 ;;
        -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "image.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
    esac
done

if ! command -v buildah >/dev/null; then
    . packaging/install-deps.sh
    install_missing buildah
fi
bins=${FIRN_BIN_DIR:-target/release}
if [ ! -x "$bins/firn-sampler" ] || [ ! -x "$bins/firn-enricher" ]; then
    if [ -n "${FIRN_BIN_DIR:-}" ]; then
        echo "image.sh: $bins has no firn-sampler or firn-enricher" >&2
        exit 1
    fi
    cargo build --release --locked --workspace --bins
fi

root=$(mktemp -d /tmp/firn-image.XXXXXX)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/usr/local/bin" "$root/etc/ssl/certs" "$root/tmp" "$root/run/firn" \
    "$root/var/lib/firn" "$root/sys/kernel/btf"
chmod 1777 "$root/tmp"
install -m 0755 "$bins/firn-sampler" "$bins/firn-enricher" "$root/usr/local/bin/"
# Debug info off (symbol tables stay: the enricher names its own frames from them).
strip --strip-debug "$root/usr/local/bin/firn-sampler" "$root/usr/local/bin/firn-enricher"
# Every shared library either binary loads, at the path the loader looks for it.
libs() {
    for b in "$bins/firn-sampler" "$bins/firn-enricher"; do
        ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }'
    done | sort -u
}
for lib in $(libs); do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
done
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
else
    echo "image.sh: no /etc/ssl/certs/ca-certificates.crt (apt-get install ca-certificates); https upload will need --otlp-ca-file/--parca-ca-file" >&2
fi
# The enricher runs as 65524, a uid of its own: not 65532 (distroless' and
# Chainguard's `nonroot`, which other pods run as; with hostPID a shared uid passes the
# kernel's ptrace checks for their /proc entries), in systemd's unallocated 65520-65533,
# outside the dynamic-user range. The sampler becomes 65533 after setup (--user).
cat >"$root/etc/passwd" <<'EOF'
root:x:0:0:root:/:/sbin/nologin
firn:x:65524:65524:firn enricher:/var/lib/firn:/sbin/nologin
firn-sampler:x:65533:65533:firn sampler after setup:/:/sbin/nologin
EOF
cat >"$root/etc/group" <<'EOF'
root:x:0:
firn:x:65524:
firn-sampler:x:65533:
EOF
chown 65524:65524 "$root/var/lib/firn"

revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
ctr=$(buildah from scratch)
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true; rm -rf "$root"' EXIT
buildah copy --quiet "$ctr" "$root" / >/dev/null
buildah config \
    --user 65524:65524 \
    --workingdir /var/lib/firn \
    --cmd /usr/local/bin/firn-enricher \
    --env FIRN_OUTPUT_DIR=/var/lib/firn/profiles \
    --label org.opencontainers.image.title=firn \
    --label "org.opencontainers.image.description=firn: continuous whole-system CPU profiler (firn-sampler, firn-enricher)" \
    --label "org.opencontainers.image.version=$version" \
    --label "org.opencontainers.image.revision=$revision" \
    --label "org.opencontainers.image.created=$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
    --label "org.opencontainers.image.licenses=$(sed -n 's/^license = "\(.*\)"/\1/p' Cargo.toml | head -1)" \
    "$ctr"
buildah commit --quiet --rm "$ctr" "$tag" >/dev/null
trap 'rm -rf "$root"' EXIT
size=$(buildah images --format '{{.Size}}' "$tag" | head -1)
echo "built $tag ($size): firn-sampler, firn-enricher, $(libs | wc -l) shared libraries, CA roots"

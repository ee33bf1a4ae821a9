#!/usr/bin/env bash
# Installs firn on this host as systemd services: the binaries to /usr/local/bin, the
# users `firn` (the enricher) and `firn-sampler` (the sampler, which never runs as root
# under the unit), the units, the docs, and then, when systemd is PID 1,
# `systemctl enable --now firn-sampler.socket firn-enricher.service`.
#
#   sudo packaging/install.sh              # builds target/release first if needed
#   sudo packaging/install.sh --no-start   # install and enable nothing
#   sudo packaging/uninstall.sh            # removes all of it (--purge: profiles too)
#
# FIRN_BIN_DIR takes the binaries from elsewhere; FIRN_ROOT installs under another root
# (a package build or a test; users and systemctl are then left alone).
set -euo pipefail
cd "$(dirname "$0")/.."

start=1
for arg in "$@"; do
    case "$arg" in
        --no-start) start=0 ;;
        -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install.sh: unknown argument $arg (try --help)" >&2; exit 2 ;;
    esac
done
root=${FIRN_ROOT:-}
if [ -z "$root" ] && [ "$(id -u)" -ne 0 ]; then
    echo "packaging/install.sh needs root (users, /usr/local/bin, units); try: sudo $0" >&2
    exit 1
fi

bins=${FIRN_BIN_DIR:-target/release}
if [ ! -x "$bins/firn-sampler" ] || [ ! -x "$bins/firn-enricher" ]; then
    if [ -n "${FIRN_BIN_DIR:-}" ]; then
        echo "install.sh: $bins has no firn-sampler or firn-enricher" >&2
        exit 1
    fi
    . packaging/install-deps.sh
    install_missing clang llvm libelf-dev zlib1g-dev make gcc pkg-config capnproto libcapnp-dev
    if ! command -v cargo >/dev/null && [ -f "$HOME/.cargo/env" ]; then
        . "$HOME/.cargo/env"
    fi
    cargo build --release --locked --workspace --bins
fi

did() { echo "  $*"; }
echo "installing firn:"
install -d "$root/usr/local/bin" "$root/etc/systemd/system" "$root/usr/local/share/doc/firn"
for b in firn-sampler firn-enricher; do
    install -m 0755 "$bins/$b" "$root/usr/local/bin/$b"
    did "/usr/local/bin/$b"
done
for u in firn-sampler.socket firn-sampler.service firn-enricher.service; do
    install -m 0644 "systemd/$u" "$root/etc/systemd/system/$u"
    did "/etc/systemd/system/$u"
done
install -m 0644 README.md sampler/README.md "$root/usr/local/share/doc/firn/" 2>/dev/null ||
    install -m 0644 README.md "$root/usr/local/share/doc/firn/"
did "/usr/local/share/doc/firn/"

if [ -n "$root" ]; then
    echo "FIRN_ROOT=$root: users and services left alone"
    exit 0
fi
# The enricher's user owns the profiles (StateDirectory=firn creates /var/lib/firn);
# the sampler's user owns nothing at all.
for u in firn firn-sampler; do
    if id "$u" >/dev/null 2>&1; then
        did "user $u exists (uid $(id -u "$u"))"
    else
        useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin \
            --user-group "$u"
        did "user $u created (uid $(id -u "$u"))"
    fi
done

if [ "$start" -eq 1 ] && [ "$(ps -p 1 -o comm= 2>/dev/null)" = systemd ]; then
    systemctl daemon-reload
    systemctl enable --now firn-sampler.socket firn-enricher.service
    did "enabled and started firn-sampler.socket, firn-enricher.service"
    echo "profiles: /var/lib/firn/profiles; web view:" \
        "http://127.0.0.1:7071/?token=\$(sudo cat /var/lib/firn/profiles/.http-token) ;" \
        "logs: journalctl -u firn-sampler -u firn-enricher"
elif [ "$start" -eq 1 ]; then
    echo "systemd is not PID 1 here: nothing enabled. On a systemd host:" \
        "systemctl enable --now firn-sampler.socket firn-enricher.service"
else
    echo "--no-start: enable with systemctl enable --now firn-sampler.socket firn-enricher.service"
fi

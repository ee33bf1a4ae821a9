#!/usr/bin/env bash
# Removes what packaging/install.sh installed: stops and disables the units, removes
# them, the binaries and the docs. The users and /var/lib/firn (the profiles) stay
# unless --purge is given.
#
#   sudo packaging/uninstall.sh [--purge]
#
# FIRN_ROOT removes from another root, as install.sh installs there.
set -euo pipefail

purge=0
for arg in "$@"; do
    case "$arg" in
        --purge) purge=1 ;;
        -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "uninstall.sh: unknown argument $arg (try --help)" >&2; exit 2 ;;
    esac
done
root=${FIRN_ROOT:-}
if [ -z "$root" ] && [ "$(id -u)" -ne 0 ]; then
    echo "packaging/uninstall.sh needs root; try: sudo $0" >&2
    exit 1
fi

did() { echo "  $*"; }
echo "removing firn:"
units=(firn-enricher.service firn-sampler.service firn-sampler.socket)
if [ -z "$root" ] && [ "$(ps -p 1 -o comm= 2>/dev/null)" = systemd ]; then
    systemctl disable --now "${units[@]}" 2>/dev/null || true
    did "stopped and disabled ${units[*]}"
fi
for u in "${units[@]}"; do
    if [ -e "$root/etc/systemd/system/$u" ]; then
        rm -f "$root/etc/systemd/system/$u"
        did "/etc/systemd/system/$u"
    fi
done
if [ -z "$root" ] && [ "$(ps -p 1 -o comm= 2>/dev/null)" = systemd ]; then
    systemctl daemon-reload
fi
for b in firn-sampler firn-enricher; do
    if [ -e "$root/usr/local/bin/$b" ]; then
        rm -f "$root/usr/local/bin/$b"
        did "/usr/local/bin/$b"
    fi
done
if [ -d "$root/usr/local/share/doc/firn" ]; then
    rm -rf "$root/usr/local/share/doc/firn"
    did "/usr/local/share/doc/firn/"
fi
if [ "$purge" -eq 1 ]; then
    if [ -d "$root/var/lib/firn" ]; then
        rm -rf "$root/var/lib/firn"
        did "/var/lib/firn (profiles)"
    fi
    if [ -z "$root" ]; then
        for u in firn firn-sampler; do
            if id "$u" >/dev/null 2>&1; then
                userdel "$u"
                did "user $u"
            fi
        done
    fi
else
    echo "kept: /var/lib/firn and the users firn, firn-sampler (--purge removes them)"
fi

#!/usr/bin/env bash
# Profiles this machine with firn: installs what is missing (Debian), builds release
# binaries, creates the unprivileged users `firn` and `firn-sampler`, starts the sampler
# as root (after setup it becomes `firn-sampler`, keeping only CAP_SYS_PTRACE, under
# seccomp) and the enricher as `firn` over a socket in a private
# runtime directory. Profiles land in $FIRN_STATE_DIR/profiles (default
# /var/lib/firn/profiles), the web view on http://127.0.0.1:7071/. Ctrl-C stops both.
# Arguments go to the sampler (e.g. --frequency 99 --round 5).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
    echo "packaging/run-local.sh needs root to start the sampler; try: sudo $0" >&2
    exit 1
fi

packages=(clang llvm libelf-dev zlib1g-dev make gcc pkg-config capnproto libcapnp-dev util-linux passwd)
. packaging/install-deps.sh
install_missing "${packages[@]}"
if ! command -v cargo >/dev/null && [ -f "$HOME/.cargo/env" ]; then
    . "$HOME/.cargo/env"
fi
cargo build --release --locked --workspace --bins

user=firn
if ! id "$user" >/dev/null 2>&1; then
    useradd --system --no-create-home --shell /usr/sbin/nologin --user-group "$user"
fi
uid=$(id -u "$user")
gid=$(id -g "$user")
# The sampler's own user after setup: root-only files stay out of its reach.
sampler_user=firn-sampler
if ! id "$sampler_user" >/dev/null 2>&1; then
    useradd --system --no-create-home --shell /usr/sbin/nologin --user-group "$sampler_user"
fi

rundir=$(mktemp -d /run/firn-local.XXXXXX)
chown "root:$gid" "$rundir"
chmod 0750 "$rundir"
socket="$rundir/sampler.sock"
# The enricher's data lives where the firn user can write it.
state=${FIRN_STATE_DIR:-/var/lib/firn}
mkdir -p "$state"
chown "$uid:$gid" "$state"
chmod 0750 "$state"

bin=target/release
"$bin/firn-sampler" --socket "$socket" --socket-group "$gid" --allow-uid "$uid" \
    --user "$sampler_user" "$@" &
sampler=$!
enricher=
cleanup() {
    trap - INT TERM EXIT
    [ -n "$enricher" ] && kill -TERM "$enricher" 2>/dev/null || true
    kill -TERM "$sampler" 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$rundir"
    echo "firn stopped"
}
trap cleanup INT TERM EXIT

for _ in $(seq 100); do
    [ -S "$socket" ] && break
    kill -0 "$sampler" 2>/dev/null || { echo "the sampler failed to start" >&2; exit 1; }
    sleep 0.1
done
http=${FIRN_HTTP_ADDRESS:-127.0.0.1:7071}
setpriv --reuid="$uid" --regid="$gid" --clear-groups --inh-caps=-all \
    "$bin/firn-enricher" --socket "$socket" --output-dir "$state/profiles" --http-address "$http" &
enricher=$!
# The HTTP token the enricher creates (its user's, 0600): every endpoint but /healthz
# wants it, so that no other local user reads the profiles.
token_file="$state/profiles/.http-token"
for _ in $(seq 100); do
    [ -s "$token_file" ] && break
    kill -0 "$enricher" 2>/dev/null || { echo "the enricher failed to start" >&2; exit 1; }
    sleep 0.1
done
token=$(cat "$token_file" 2>/dev/null || true)
cat <<MSG
firn is running: sampler pid $sampler (user $sampler_user, CAP_SYS_PTRACE + seccomp),
enricher pid $enricher (user $user, no capabilities).
  profiles:  $state/profiles/<UTC time>-r<round>/pid-<pid>.pb.gz (index.jsonl lists labels)
  web view:  http://$http/?token=$token
  metrics:   curl -H "Authorization: Bearer \$(sudo cat $token_file)" http://$http/metrics
  whole host, last minute:  go tool pprof -http=: 'http://$http/pprof/cpu?seconds=60&token=$token'
Ctrl-C stops both.
MSG
wait -n "$sampler" "$enricher" || true

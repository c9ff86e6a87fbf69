#!/usr/bin/env bash
# Developer entry point.
#   ./dev.sh setup         install what is missing (Debian packages, .venv); fast when nothing is
#   ./dev.sh demo [args]   setup, then `pginbox demo [args]` against a private cluster in .pginbox/
#   ./dev.sh test [args]   setup, then tests/run [args]
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$ROOT"

DEB_PACKAGES=(
    postgresql-15
    postgresql-15-pgtap
    postgresql-15-plpgsql-check
    postgresql-15-cron
    postgresql-15-plproxy   # the routing layer (proxy/, docs/scaling.md, tests/python/e2e/test_proxy.py)
    sqitch
    libdbd-pg-perl
    libtap-parser-sourcehandler-pgtap-perl
    python3-venv
    pgbouncer
    # the other-language examples (examples/, tests/python/e2e/test_other_languages.py)
    nodejs
    golang-go
    golang-github-jackc-pgx-v4-dev
    openjdk-17-jdk-headless
    libpostgresql-jdbc-java
    rabbitmq-server   # the broker tests' RabbitMQ (127.0.0.1:5672) and private nodes
    nats-server       # the broker tests' NATS JetStream (127.0.0.1:4222) and private servers
    redis-server      # the Redis Streams tests (127.0.0.1:6379)
)
VENV="$ROOT/.venv"
STAMP="$VENV/.pginbox-setup-stamp"

log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'dev.sh: %s\n' "$*" >&2; exit 1; }

as_root() {
    if [[ $(id -u) -eq 0 ]]; then
        "$@"
    elif command -v sudo >/dev/null; then
        sudo "$@"
    else
        die "need root to run: $* (sudo is not installed)"
    fi
}

missing_debian_packages() {
    local pkg
    for pkg in "${DEB_PACKAGES[@]}"; do
        if [[ $(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true) != "install ok installed" ]]; then
            printf '%s\n' "$pkg"
        fi
    done
}

setup_debian_packages() {
    if ! command -v dpkg-query >/dev/null; then
        log "not a Debian system: make sure these are installed: ${DEB_PACKAGES[*]}"
        return
    fi
    local missing
    mapfile -t missing < <(missing_debian_packages)
    if [[ ${#missing[@]} -eq 0 ]]; then
        return
    fi
    log "installing Debian packages: ${missing[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update
    as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y --no-install-recommends "${missing[@]}"
}

system_python() {
    # The Debian interpreter (python3-venv belongs to it), not whatever shim is first on PATH.
    if [[ -x /usr/bin/python3 ]]; then
        echo /usr/bin/python3
    else
        command -v python3 || die "python3 not found"
    fi
}

setup_venv() {
    local want have=""
    # Re-run pip only when pyproject.toml (or the interpreter) changed.
    want=$({ cat python/pyproject.toml; readlink -f "$(system_python)"; } | sha256sum | cut -d' ' -f1)
    [[ -f $STAMP ]] && have=$(cat "$STAMP")
    if [[ $want == "$have" && -x $VENV/bin/python && -x $VENV/bin/pginbox ]] \
        && "$VENV/bin/python" -c '' 2>/dev/null; then
        return
    fi
    if [[ ! -x $VENV/bin/python ]] || ! "$VENV/bin/python" -c '' 2>/dev/null; then
        log "creating $VENV"
        rm -rf "$VENV"
        "$(system_python)" -m venv "$VENV"
    fi
    log "installing python package (editable) with dev extras into $VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT/python[dev]"
    echo "$want" >"$STAMP"
}

setup_examples() {
    # Node's example needs npm (Debian's nodejs comes without it; NodeSource's brings its own) and
    # `pg` from npm, pinned by examples/node/package-lock.json; npm's cache stays in .cache/npm.
    if ! command -v npm >/dev/null; then
        log "installing Debian package npm"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends npm
    fi
    local dir=$ROOT/examples/node
    if [[ ! -f $dir/node_modules/.package-lock.json || $dir/package-lock.json -nt $dir/node_modules/.package-lock.json ]]; then
        log "installing examples/node's packages (npm ci)"
        npm ci --prefix "$dir" --cache "$ROOT/.cache/npm" --no-audit --no-fund --loglevel=error
    fi
}

setup() {
    setup_debian_packages
    setup_venv
    setup_examples
}

usage() {
    sed -n '2,5s/^# \{0,1\}//p' "$0" >&2
    exit 2
}

cmd=${1:-}
[[ $# -gt 0 ]] && shift
case $cmd in
    setup) setup ;;
    demo)
        setup
        exec "$VENV/bin/pginbox" demo "$@"
        ;;
    test)
        setup
        exec "$ROOT/tests/run" "$@"
        ;;
    *) usage ;;
esac

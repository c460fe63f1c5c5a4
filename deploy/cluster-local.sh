#!/usr/bin/env bash
# A whole dmq cluster on one machine, for trying it out: PostgreSQL, ZooKeeper and
# three dmq nodes, all under ./dmq-cluster (relative to the repository root).
#
#   bash deploy/cluster-local.sh            # start everything; Ctrl-C stops everything
#   bash deploy/cluster-local.sh --ha       # PostgreSQL as a Patroni cluster of three
#                                           # (deploy/ha-local.sh says the same)
#   ZK_PORT=2182 BASE_PORT=5150 bash deploy/cluster-local.sh
#   DMQ_PYTHON=python3 bash deploy/cluster-local.sh   # an interpreter that has dmq
#                                                    # installed already (no .venv setup)
#
# What runs (defaults):
#   PostgreSQL  private server under dmq-cluster/pg (dmq_server.db.embedded), 127.0.0.1;
#               with --ha: three members pg1..pg3 under Patroni (deploy/patroni_local.py),
#               synchronous and strict, PostgreSQL on 127.0.0.1:$PG_PORT, +2, +4 (5432)
#               and Patroni's REST API one above each, data in dmq-ha/patroni/pgN
#   ZooKeeper   standalone, 127.0.0.1:$ZK_PORT (2181), data in dmq-cluster/zk
#   node1       TCP 127.0.0.1:4150  HTTP :4151  admin console :4152
#   node2       TCP 127.0.0.1:4250  HTTP :4251  admin console :4252
#   node3       TCP 127.0.0.1:4350  HTTP :4351  admin console :4352
# Logs: dmq-cluster/*.log. Try:
#   .venv/bin/dmq --zk 127.0.0.1:2181/dmq-local topic create orders
#   .venv/bin/dmq --zk 127.0.0.1:2181/dmq-local channel add orders billing
#   .venv/bin/dmq --zk 127.0.0.1:2181/dmq-local node list
#   curl 'http://127.0.0.1:4151/lookup?topic=orders'         # every node, from any node
#   kill -9 "$(cat dmq-cluster/node2.pid)"                   # node1 or node3 takes over its messages
# docs/operations.md explains the cluster; deploy/cluster/ has production configs.
set -Eeuo pipefail

trap 'echo "deploy/cluster-local.sh: failed (exit $?) at line $LINENO: $BASH_COMMAND" >&2' ERR

ha=0
case "${1:-}" in
    --ha) ha=1 ;;
    "") ;;
    *) echo "usage: bash deploy/cluster-local.sh [--ha]" >&2; exit 2 ;;
esac
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
if [ -n "${DMQ_PYTHON:-}" ]; then
    py="$DMQ_PYTHON"
elif [ "$ha" -eq 1 ]; then
    bash "$repo/deploy/setup.sh" --ha
    py="$repo/.venv/bin/python"
else
    bash "$repo/deploy/setup.sh"
    py="$repo/.venv/bin/python"
fi
zk_port="${ZK_PORT:-2181}"
base_port="${BASE_PORT:-4150}"
pg_port="${PG_PORT:-5432}"
chroot="/dmq-local"
work="$repo/dmq-cluster"
[ "$ha" -eq 1 ] && work="$repo/dmq-ha"
mkdir -p "$work"
chmod 755 "$work"  # the embedded PostgreSQL runs as an unprivileged user when we are root

# -- ZooKeeper's jars (Debian's package) ------------------------------------------------
zk_jar=/usr/share/java/zookeeper.jar
if [ ! -f "$zk_jar" ]; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing Debian's zookeeper package..."
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends zookeeper >/dev/null \
            || { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends zookeeper >/dev/null; }
    else
        echo "deploy/cluster-local.sh: needs ZooKeeper: apt-get install zookeeper (as root)" >&2
        exit 1
    fi
fi
command -v java >/dev/null 2>&1 || { echo "deploy/cluster-local.sh: needs a Java runtime (default-jre-headless)" >&2; exit 1; }

zk_pid=""
pg_started=0  # stop only what this run started (not another run's PostgreSQL)
node_pids=()
stop_all() {  # stop_all PID...: SIGTERM, then SIGKILL after 60 s
    local pid
    for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
    for _ in $(seq 600); do
        local alive=0
        for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" -eq 0 ] && return 0
        sleep 0.1
    done
    for pid in "$@"; do kill -KILL "$pid" 2>/dev/null || true; done
}
cleanup() {
    trap - INT TERM EXIT ERR
    echo "stopping..."
    # nodes first, while ZooKeeper is still there for them to leave the cluster
    if [ "${#node_pids[@]}" -gt 0 ]; then stop_all "${node_pids[@]}"; fi
    if [ -n "$zk_pid" ]; then stop_all "$zk_pid"; fi
    if [ "$pg_started" -eq 1 ] && [ "$ha" -eq 1 ]; then
        "$py" "$repo/deploy/patroni_local.py" stop "$work/patroni" || true
    elif [ "$pg_started" -eq 1 ]; then
        "$py" -c 'import sys; from pathlib import Path; from dmq_server.db.embedded import EmbeddedPostgres; EmbeddedPostgres(Path(sys.argv[1])).stop()' "$work" || true
    fi
    echo "stopped (data kept in $work)"
    exit "$1"
}
trap 'cleanup 0' INT TERM
trap 'cleanup $?' EXIT

ready() {  # ready node ID HTTP-PORT PID LOG | ready zookeeper PORT PID LOG: up to 60 s
    # The answer must come from our own process (node id in /info, process alive):
    # another server on the port does not count. On failure it prints the log's tail.
    "$py" "$repo/deploy/cluster_ready.py" "$@" || exit 1
}

ports=("$zk_port")
for n in 1 2 3; do
    tcp=$((base_port + (n - 1) * 100))
    ports+=("$tcp" "$((tcp + 1))" "$((tcp + 2))")
done
if [ "$ha" -eq 1 ]; then
    for i in 0 1 2 3 4 5; do ports+=("$((pg_port + i))"); done
fi
"$py" "$repo/deploy/cluster_ready.py" free "${ports[@]}" || exit 1

# -- ZooKeeper (standalone) -----------------------------------------------------------------
mkdir -p "$work/zk/data"
# with --ha, 500 ms ticks: sessions of 1..10 s, so Patroni's (ttl 20, capped to 10 s) ends,
# and a dead primary's leader key goes, within 10 s
tick=2000
[ "$ha" -eq 1 ] && tick=500
cat > "$work/zk/zoo.cfg" <<EOF
tickTime=$tick
dataDir=$work/zk/data
clientPort=$zk_port
clientPortAddress=127.0.0.1
admin.enableServer=false
4lw.commands.whitelist=ruok,srvr,stat,mntr
EOF
classpath="$zk_jar"
[ -f /usr/share/java/slf4j-simple.jar ] && classpath="$classpath:/usr/share/java/slf4j-simple.jar"
java -Xmx256m -Dorg.slf4j.simpleLogger.defaultLogLevel=warn -cp "$classpath" \
    org.apache.zookeeper.server.quorum.QuorumPeerMain "$work/zk/zoo.cfg" >"$work/zookeeper.log" 2>&1 &
zk_pid=$!
ready zookeeper "$zk_port" "$zk_pid" "$work/zookeeper.log"

# -- PostgreSQL -----------------------------------------------------------------------------
pg_started=1
if [ "$ha" -eq 1 ]; then
    # three members under Patroni, its DCS the ZooKeeper above; waits for a primary and a
    # synchronous standby, creates the dmq role and database, prints dmq's multi-host DSN
    dsn="$("$py" "$repo/deploy/patroni_local.py" start "$work/patroni" "127.0.0.1:$zk_port" "$pg_port")"
else
    dsn="$("$py" -c 'import sys; from pathlib import Path; from dmq_server.db.embedded import EmbeddedPostgres; print(EmbeddedPostgres(Path(sys.argv[1])).start())' "$work")"
fi
"$py" -m dmq_server.admin.cli --pg-dsn "$dsn" db migrate >/dev/null

# -- three dmq nodes --------------------------------------------------------------------------
for n in 1 2 3; do
    tcp=$((base_port + (n - 1) * 100))
    "$py" -m dmq_server.main \
        --pg-dsn "$dsn" \
        --zk "127.0.0.1:$zk_port$chroot" \
        --node-id "node$n" \
        --data-path "$work/node$n" \
        --tcp-address "127.0.0.1:$tcp" \
        --http-address "127.0.0.1:$((tcp + 1))" \
        --admin-address "127.0.0.1:$((tcp + 2))" \
        >"$work/node$n.log" 2>&1 &
    node_pids+=($!)
    echo $! >"$work/node$n.pid"
done
for n in 1 2 3; do
    ready node "node$n" "$((base_port + (n - 1) * 100 + 1))" "${node_pids[$((n - 1))]}" "$work/node$n.log"
done

cat <<EOF
dmq cluster is ready
  PostgreSQL  $dsn
  ZooKeeper   127.0.0.1:$zk_port$chroot   ($py -m dmq_server.admin.cli --zk 127.0.0.1:$zk_port$chroot ...)
  node1       TCP 127.0.0.1:$base_port  HTTP http://127.0.0.1:$((base_port + 1))/  admin console 127.0.0.1:$((base_port + 2))
  node2       TCP 127.0.0.1:$((base_port + 100))  HTTP http://127.0.0.1:$((base_port + 101))/  admin console 127.0.0.1:$((base_port + 102))
  node3       TCP 127.0.0.1:$((base_port + 200))  HTTP http://127.0.0.1:$((base_port + 201))/  admin console 127.0.0.1:$((base_port + 202))
  logs        $work/*.log
EOF
if [ "$ha" -eq 1 ]; then
    cat <<EOF
  Patroni     pg1..pg3: PostgreSQL 127.0.0.1:$pg_port, $((pg_port + 2)), $((pg_port + 4)); REST API one port above each
              patronictl -c $work/patroni/pg1/patroni.yml list      # who leads, who is synchronous
EOF
fi
echo "Ctrl-C stops everything."
wait  # until Ctrl-C (a node killed to try a takeover does not end the others)

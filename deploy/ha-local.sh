#!/usr/bin/env bash
# dmq on a highly available PostgreSQL, all on one machine: ZooKeeper, a Patroni cluster
# of a primary and two standbys (synchronous_mode_strict), and three dmq nodes that
# reach the primary through a multi-host DSN (target_session_attrs=read-write).
#
#   bash deploy/ha-local.sh                 # start everything; Ctrl-C stops everything
#   PG_PORT=6432 ZK_PORT=2182 BASE_PORT=5150 bash deploy/ha-local.sh
#
# Everything listens on 127.0.0.1 only; data and logs under ./dmq-ha. It is
# deploy/cluster-local.sh --ha: see that script for the ports, and docs/operations.md
# ("PostgreSQL high availability") for what to try (kill the primary under load).
exec bash "$(dirname "${BASH_SOURCE[0]}")/cluster-local.sh" --ha "$@"

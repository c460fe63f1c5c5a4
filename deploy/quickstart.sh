#!/usr/bin/env bash
# Quick start: install dmq (deploy/setup.sh) and run a server on ./dmq-data.
#
#   bash deploy/quickstart.sh [dmq-server options...]
#
# Why: one command from a fresh clone to a running, durable message server.  The
# server starts its own private PostgreSQL under dmq-data/pg (see
# dmq_server/db/embedded.py), so nothing else needs installing or configuring.
# The data directory is relative to the repository root, whatever the caller's
# current directory, so repeated runs always find the same data.
set -Eeuo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/deploy/setup.sh"
cd "$repo"
exec "$repo/.venv/bin/dmq-server" --data-path ./dmq-data "$@"

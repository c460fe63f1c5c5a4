"""``dmq outbox``: the outbox schema in an application's own database.

``install`` creates (or brings up to date) the schema an application's transactions send
through and record consumed messages in, and prints the grants its role needs;
``uninstall`` drops it, refusing while messages wait to be relayed; ``retag`` gives the
install a new tag (after its row ids went back: a restore from a backup); ``prune-inbox``
deletes old inbox records in bounded batches. Each takes the application database's
``--dsn``, not dmq's ``--pg-dsn``: the schema lives beside the application's tables so
its writes and its messages commit together (docs/client.md, "Transactional messages").
``attach`` records an outbox in dmq's own database (``--pg-dsn``; with ``--zk`` it also
shows it under ZooKeeper's ``/dmq/outbox``, which tells a cluster's nodes at once), once
it found the outbox installed at a version the relay reads (2 or later:
``RELAY_MIN_VERSION``); every running node then relays it within a few seconds, and stops
after ``detach``, without a restart.
``list`` asks a running server (``--http-address``, its admin API) what it relays: only
the server holds the relays' figures, and it never answers with a DSN.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from dmq_server.admin.cli_support import CliError, admin_get
from dmq_server.core.errors import DmqError
from dmq_server.core.outbox_rows import OutboxSource
from dmq_server.core.outbox_figures import PENDING_BOUND, OutboxJson
from dmq_server.db.storage_errors import StorageError
from dmq_client.spelling import parse_duration

__all__ = ["add_outbox_commands"]


def cmd_outbox(args: argparse.Namespace) -> None:
    from dmq_server.db import outbox

    if args.action == "list":
        _list(args)
        return
    try:
        if args.action in ("attach", "detach"):
            _attach_or_detach(args)
        elif args.action == "install":
            applied, version = outbox.install(args.dsn, args.schema)
            done = f"applied {', '.join(map(str, applied))}" if applied else "already up to date"
            print(f"outbox schema {args.schema} is at version {version} ({done})")
            print("an application role needs these grants, and nothing more:")
            for line in outbox.grants_for(args.schema, args.role):
                print(f"  {line}")
        elif args.action == "uninstall":
            dropped = outbox.uninstall(args.dsn, args.schema, force=args.force)
            print(f"dropped outbox schema {args.schema}" + (f" with {dropped} unrelayed message(s)" if dropped else ""))
        elif args.action == "retag":
            old, new = outbox.retag(args.dsn, args.schema)
            print(f"outbox schema {args.schema}: tag {old} -> {new} (rows relayed from now on are producer "
                  f"outbox:NAME:{new})")
        elif args.action == "prune-inbox":
            removed = outbox.prune_inbox(args.dsn, args.older_than, args.schema, batch=args.batch)
            print(f"pruned {removed} inbox record(s) older than {args.older_than:g}s from {args.schema}.inbox")
    except StorageError as exc:
        raise CliError(str(exc), 3) from exc
    except DmqError as exc:
        raise CliError.of(exc) from exc


def _attach_or_detach(args: argparse.Namespace) -> None:
    """``dmq outbox attach|detach``: the row in dmq's database first, then ZooKeeper's
    entry (nodes read the table; the znode only hurries them, so a ZooKeeper that fails
    after the row was written delays the change by at most --registry-refresh)."""
    from dmq_server.admin.cli_support import open_database
    from dmq_server.core.outbox_rows import parse_outbox
    from dmq_server.db import outbox, outbox_attached

    if args.action == "attach":
        try:
            source = parse_outbox(f"{args.name}:{args.schema}={args.dsn}")
        except ValueError as exc:
            raise CliError(str(exc), 2) from exc
        version = outbox.check_installed(source.dsn, source.schema)
        with open_database(args) as conn:
            outbox_attached.attach(conn, source)
    else:
        with open_database(args) as conn:
            source = outbox_attached.detach(conn, args.name)
    where = outbox.dsn_database(source.dsn)  # never the DSN: it may hold a password
    if args.zk:
        _tell_zookeeper(args, source, where)
    if args.action == "attach":
        print(f"attached outbox {source.name} ({source.schema} at version {version} in {where}): "
              "running nodes relay it within a few seconds")
    else:
        print(f"detached outbox {source.name} ({source.schema} in {where}): running nodes stop relaying it "
              "within a few seconds (a node started with --outbox of that name keeps its own)")


def _tell_zookeeper(args: argparse.Namespace, source: OutboxSource, where: str) -> None:
    from registry import outboxes
    from registry.model import RegistryError
    from registry.zk import connect

    try:
        client = connect(args.zk, timeout=args.zk_timeout)
    except (RegistryError, ValueError) as exc:
        raise CliError(f"{exc} (the outbox is {args.action}ed in dmq's database: nodes follow within "
                       "--registry-refresh all the same)", 3) from exc
    try:
        if args.action == "attach":
            outboxes.mirror_attached(client, source.name, source.schema, where)
        else:
            outboxes.remove_attached(client, source.name)
    finally:
        client.stop()
        client.close()


def _outboxes(args: argparse.Namespace) -> list[OutboxJson]:
    """``GET /admin/outboxes`` of the server at --http-address."""
    outboxes = admin_get(args, "outboxes").get("outboxes")
    if not isinstance(outboxes, list):
        raise CliError(f"http://{args.http_address}/admin/outboxes answered no list of outboxes", 3)
    shown: list[OutboxJson] = outboxes  # the admin API's items (http.admin_api)
    return shown


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _list(args: argparse.Namespace) -> None:
    """``dmq outbox list``: one line per outbox the server relays or stands by for."""
    outboxes = _outboxes(args)
    if args.json:
        print(json.dumps(outboxes, indent=2))
        return
    if not outboxes:
        print("no outboxes on this server (--outbox, dmq outbox attach)")
        return
    header = ("NAME", "SOURCE", "SCHEMA", "DATABASE", "RELAYING NODE", "PENDING", "OLDEST", "RELAYED", "DEAD")
    rows = [header]
    for o in outboxes:
        pending = "-" if o["pending"] is None else f"{o['pending']}{'+' if o['pending_at_least'] else ''}"
        node = o["relaying_node"] or "none"
        rows.append((o["name"], "attached" if o.get("attached") else "--outbox", o["schema"], o["database"], node + (" (this node)" if o["relaying"] else ""),
                     pending, _age(o["oldest_pending_seconds"]), str(o["relayed"]), str(o["dead_lettered"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _seconds(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_outbox_commands(sub: Any) -> None:
    """``dmq outbox install|uninstall|retag|prune-inbox|attach|detach|list`` on the parser's subcommands."""
    outbox = sub.add_parser(
        "outbox", help="the outbox and inbox in an application's database",
        description="install, uninstall, retag and prune-inbox work on the application's database (--dsn); "
        "attach and detach tell every running dmq-server to relay an outbox, or to stop, without a restart "
        "(kept in dmq's database, --pg-dsn; with --zk the cluster's nodes hear of it at once); list asks a "
        "running server (--http-address) what it relays. docs/client.md, \"Transactional messages\".")
    osub = outbox.add_subparsers(dest="action", required=True)
    install = osub.add_parser("install", help="create or update the outbox schema; print the grants it needs")
    install.add_argument("--role", default="APP_ROLE", help="the application role named in the printed grants")
    uninstall = osub.add_parser("uninstall", help="drop the outbox schema (refused while messages wait)")
    uninstall.add_argument("--force", action="store_true", help="drop it even with unrelayed messages in it")
    retag = osub.add_parser(
        "retag",
        help="give the install a new tag (after a restore of the application database from a backup)",
        description="Rows are relayed as producer outbox:NAME:TAG with their id as session id. After the "
        "outbox's ids went back (the application database restored from a backup, TRUNCATE ... RESTART "
        "IDENTITY), new rows would reuse ids already relayed and be taken for repeats: run this before "
        "relaying again. Rows still in the outbox are relayed under the new tag too, so one relayed "
        "before the restore is delivered again (docs/client.md).",
    )
    prune = osub.add_parser(
        "prune-inbox",
        help="delete inbox records older than a duration, in bounded batches",
        description="Keep --older-than above the longest time a consumed message can still be "
        "redelivered (the topic's --message-retention and message timeout): a record pruned "
        "earlier lets a late redelivery run its handler again.",
    )
    prune.add_argument("--older-than", required=True, type=_seconds, metavar="DURATION",
                       help="records processed longer ago than this go (e.g. 7d)")
    prune.add_argument("--batch", type=int, default=10000, help="records deleted per transaction (default 10000)")
    attach = osub.add_parser(
        "attach",
        help="relay an outbox from every running node, without a restart (kept in dmq's database)",
        description="Records the outbox in dmq's own database (--pg-dsn), once its schema is installed "
        "at this dmq's version in the application database; every running node starts relaying it within "
        "--registry-refresh (with --zk at once: ZooKeeper's /dmq/outbox tells the nodes). One node relays it "
        "at a time. The DSN is kept in dmq's database only and never shown. A node started with "
        "--outbox of the same NAME relays its own and ignores the attached one.",
    )
    attach.add_argument("name", help="the outbox's name: its messages' producer is outbox:NAME:TAG")
    detach = osub.add_parser(
        "detach",
        help="stop relaying an attached outbox on every node (its rows stay in the outbox)",
        description="Removes the outbox from dmq's database; each running node stops its relay within "
        "--registry-refresh (with --zk at once), after deleting the rows it stored. Rows not relayed yet "
        "stay in the application's outbox until it is attached again.",
    )
    detach.add_argument("name")
    for parser in (install, uninstall, retag, prune, attach):
        parser.add_argument("--dsn", required=True, help="the APPLICATION's PostgreSQL (not dmq's)")
        parser.add_argument("--schema", default="dmq_outbox", help="the schema's name (default dmq_outbox)")
    listing = osub.add_parser(
        "list", help="the outboxes a running server relays (its admin API at --http-address)",
        description=f"PENDING is counted up to {PENDING_BOUND} (shown as {PENDING_BOUND}+: at least that many); "
        "RELAYED and DEAD "
        "count rows this server relayed since it started; RELAYING NODE is the node holding the outbox's lock; "
        "SOURCE says whether the server was started with it (--outbox) or it was attached (dmq outbox attach).")
    listing.add_argument("--admin-token", default=os.environ.get("DMQ_ADMIN_TOKEN"),
                         help="the server's --admin-token (env DMQ_ADMIN_TOKEN)")
    listing.add_argument("--json", action="store_true")
    outbox.set_defaults(func=cmd_outbox)

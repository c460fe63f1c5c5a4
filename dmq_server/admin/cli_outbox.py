"""``dmq outbox``: the outbox schema in an application's own database.

``install`` creates (or brings up to date) the schema an application's transactions send
through and record consumed messages in, and prints the grants its role needs;
``uninstall`` drops it, refusing while messages wait to be relayed; ``prune-inbox``
deletes old inbox records in bounded batches. Each takes the application database's
``--dsn``, not dmq's ``--pg-dsn``: the schema lives beside the application's tables so
its writes and its messages commit together (docs/client.md, "Transactional messages").
"""

from __future__ import annotations

import argparse
from typing import Any

from dmq_server.admin.cli_support import CliError
from dmq_server.core.errors import DmqError
from dmq_server.db.storage_errors import StorageError
from dmq_client.spelling import parse_duration

__all__ = ["add_outbox_commands"]


def cmd_outbox(args: argparse.Namespace) -> None:
    from dmq_server.db import outbox

    try:
        if args.action == "install":
            applied, version = outbox.install(args.dsn, args.schema)
            done = f"applied {', '.join(map(str, applied))}" if applied else "already up to date"
            print(f"outbox schema {args.schema} is at version {version} ({done})")
            print("an application role needs these grants, and nothing more:")
            for line in outbox.grants_for(args.schema, args.role):
                print(f"  {line}")
        elif args.action == "uninstall":
            dropped = outbox.uninstall(args.dsn, args.schema, force=args.force)
            print(f"dropped outbox schema {args.schema}" + (f" with {dropped} unrelayed message(s)" if dropped else ""))
        elif args.action == "prune-inbox":
            removed = outbox.prune_inbox(args.dsn, args.older_than, args.schema, batch=args.batch)
            print(f"pruned {removed} inbox record(s) older than {args.older_than:g}s from {args.schema}.inbox")
    except StorageError as exc:
        raise CliError(str(exc), 3) from exc
    except DmqError as exc:
        raise CliError.of(exc) from exc


def _seconds(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_outbox_commands(sub: Any) -> None:
    """``dmq outbox install|uninstall|prune-inbox`` on the parser's subcommands."""
    outbox = sub.add_parser("outbox", help="the outbox and inbox in an application's database")
    osub = outbox.add_subparsers(dest="action", required=True)
    install = osub.add_parser("install", help="create or update the outbox schema; print the grants it needs")
    install.add_argument("--role", default="APP_ROLE", help="the application role named in the printed grants")
    uninstall = osub.add_parser("uninstall", help="drop the outbox schema (refused while messages wait)")
    uninstall.add_argument("--force", action="store_true", help="drop it even with unrelayed messages in it")
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
    for parser in (install, uninstall, prune):
        parser.add_argument("--dsn", required=True, help="the APPLICATION's PostgreSQL (not dmq's)")
        parser.add_argument("--schema", default="dmq_outbox", help="the schema's name (default dmq_outbox)")
    outbox.set_defaults(func=cmd_outbox)

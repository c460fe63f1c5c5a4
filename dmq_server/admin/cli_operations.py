"""``dmq dlq ...``, ``dmq delay stats`` and ``dmq clients``: the CLI's admin commands.

Dead letters and delay stats go straight to PostgreSQL (like the rest of the
CLI, so they work with no server running): ``admin.operations`` holds the operations,
shared with the HTTP admin API and the admin console. A replay queues each
dead letter in the delay table, due at once, for its own channel; whichever
node serves the fragment delivers it within one polling interval. Long
operations print progress to stderr after every batch. ``dmq clients`` asks a
running server (``--http-address``, ``--admin-token``), since only it knows its
connections.
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import json
import os
import socket
import sys
import time
from typing import Any, Mapping

from dmq_server.admin.operations import (
    DEFAULT_BATCH,
    DeadLetterFilter,
    count_dead_letters_steps,
    delete_batch_steps,
    list_dead_letters_steps,
    log_operation_steps,
    parse_limit,
    replay_batch_steps,
    require_selection,
    run_batches,
    show_dead_letter_steps,
)

from dmq_server.admin.cli_support import CliError, admin_get, cluster_of_id, open_clusters, open_database
from dmq_server.core.errors import NotFound, Refused
from dmq_server.db.steps import run_steps

__all__ = ["add_admin_commands"]



def _filter(args: argparse.Namespace) -> DeadLetterFilter:
    raw: dict[str, str] = {}
    for key in ("topic", "channel", "reason", "since", "until", "message_ids"):
        value = getattr(args, key, None)
        if value is not None:
            raw[key] = value
    ids = list(getattr(args, "ids_opt", None) or []) + [str(i) for i in getattr(args, "id_list", None) or []]
    if ids:
        raw["ids"] = ",".join(ids)
    if getattr(args, "replayed", None) is not None:
        raw["replayed"] = "true" if args.replayed else "false"
    try:
        return DeadLetterFilter.parse(raw)
    except Refused as exc:
        raise CliError(exc.description, 2) from exc


def _actor() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no user name in this environment
        user = "?"
    return f"{user}@{socket.gethostname()}"


class _Progress:
    """``replayed 5000/100000 (5%), 12000/s`` on stderr; one line per batch, or one
    line rewritten in place on a terminal."""

    def __init__(self, verb: str, total: int, quiet: bool):
        self.verb = verb
        self.total = total
        self.quiet = quiet
        self.started = time.monotonic()
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int) -> None:
        if self.quiet:
            return
        elapsed = max(time.monotonic() - self.started, 1e-6)
        pct = f" ({100 * done // self.total}%)" if self.total else ""
        line = f"{self.verb} {done}/{self.total}{pct}, {done / elapsed:.0f}/s"
        if self.tty:
            sys.stderr.write("\r" + line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def finish(self) -> float:
        if self.tty and not self.quiet:
            sys.stderr.write("\n")
        return time.monotonic() - self.started


def _properties_columns(r: Mapping[str, object]) -> str:
    """A message's key, priority and headers as three tab-separated columns ("-" for
    none; headers as compact JSON). The send rules allow no control characters in a key
    or a header, so a tab in them cannot shift a column."""
    key = r["key"] if r["key"] is not None else "-"
    headers = json.dumps(r["headers"], ensure_ascii=False, separators=(",", ":")) if r["headers"] else "-"
    return f"{key}\t{r['priority']}\t{headers}"


def _properties_lines(r: Mapping[str, object]) -> list[str]:
    """A traced message's (or delay entry's) properties as lines under its first: none for
    a message without any, so its trace reads as before properties existed."""
    headers = r["headers"] if isinstance(r["headers"], dict) else {}
    if r["key"] is None and not r["priority"] and not headers:
        return []
    key = r["key"] if r["key"] is not None else "-"
    traced = [f"  trace id {r['trace_id']}"] if r.get("trace_id") else []
    return ([f"  key {key}, priority {r['priority']}"] + traced
            + [f"  header {name}: {value}" for name, value in headers.items()])


def _print_letters(rows: list[dict], as_json: bool) -> None:
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        print("no dead letters match")
        return
    print("id\treason\ttopic/channel\tproducer:session\tmessage\tattempts\tdead at (UTC)\treplayed"
          "\tkey\tpriority\theaders")
    for r in rows:
        dead = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["dead_ms"] / 1000)) if r["dead_ms"] else "-"
        replayed = f"-> {r['replay_message_id'] or 'queued'}" if r["replayed_ms"] else "-"
        print(
            f"{r['id']}\t{r['reason']}\t{r['topic']}/{r['channel'] or '*'}\t"
            f"{r['producer']}:{r['session_id']}\t{r['message_id'] or '-'}\t{r['attempts']}\t{dead}\t{replayed}"
            f"\t{_properties_columns(r)}"
        )


def cmd_dlq(args: argparse.Namespace) -> None:
    """Dead letters live on their topic's cluster: ``list`` looks in every cluster given
    (``--pg-cluster``) or the one ``--cluster`` names, ``show`` in the one that drew the
    id, ``replay`` and ``delete`` run on each in turn (named ids: on theirs)."""
    if args.action == "show":
        args.cluster = cluster_of_id(args, args.id)
    elif args.action in ("replay", "delete") and getattr(args, "cluster", None) is None:
        ids = list(getattr(args, "ids_opt", None) or []) + [str(i) for i in getattr(args, "id_list", None) or []]
        named = {cluster_of_id(args, int(i)) for part in ids for i in part.split(",") if i.strip().isdigit()}
        if len(named) == 1:
            args.cluster = named.pop()
    with open_clusters(args) as conns:
        try:
            if args.action == "list":
                flt = _filter(args)
                limit = parse_limit(args.limit)
                rows = []
                for name, conn in conns.items():
                    rows += [dict(r, cluster=name) if len(conns) > 1 else r
                             for r in run_steps(conn, list_dead_letters_steps(flt, limit, args.after))]
                _print_letters(sorted(rows, key=lambda r: r["id"])[:limit], args.json)
            elif args.action == "show":
                row = run_steps(next(iter(conns.values())), show_dead_letter_steps(args.id))
                print(json.dumps(row, indent=2))
            elif args.action in ("replay", "delete"):
                for name, conn in conns.items():
                    if len(conns) > 1:
                        print(f"cluster {name}:")
                    _destructive(conn, args)
        except Refused as exc:
            raise CliError.of(exc) from exc


def _destructive(conn: Any, args: argparse.Namespace) -> None:
    flt = _filter(args)
    require_selection(flt, args.all, args.action)
    if args.batch < 1:
        raise CliError("--batch must be at least 1", 2)
    total, not_replayed = run_steps(conn, count_dead_letters_steps(flt))
    if total == 0 and flt.ids:
        # named ids that are not there: the same answer as the HTTP API's 404, exit 1
        # (a filter that matches nothing is not an error: "deleted 0")
        named = ", ".join(str(i) for i in flt.ids)
        also = "" if dataclasses.replace(flt, ids=None).is_empty() else " matching the other filters"
        raise NotFound(f"no dead letter{'s' if len(flt.ids) > 1 else ''} {named}{also}")
    batch = args.batch
    if args.action == "replay":
        fragments = args.delay_fragments
        progress = _Progress("replayed", not_replayed, args.quiet)

        def step(after: int):
            return run_steps(conn, replay_batch_steps(flt, after, batch, fragments, int(time.time() * 1000), "cli"))

        verb = "replayed"
    else:
        progress = _Progress("deleted", total, args.quiet)

        def step(after: int):
            return run_steps(conn, delete_batch_steps(flt, after, batch))

        verb = "deleted"
    done = run_batches(step, progress)
    seconds = progress.finish()
    run_steps(conn, log_operation_steps("cli", _actor(), f"dlq.{args.action}", flt.describe(), done))
    rate = f", {done / seconds:.0f}/s" if seconds > 0 and done else ""
    print(f"{verb} {done} dead letters in {seconds:.2f}s{rate}")
    if args.action == "replay" and done:
        print("queued for delivery: each goes to its own channel within one --delay-poll-interval")


def cmd_delay(args: argparse.Namespace) -> None:
    from dmq_server.db.delays import delay_stats_steps

    with open_clusters(args) as conns:
        per = {name: run_steps(conn, delay_stats_steps()) for name, conn in conns.items()}
    pending = sum(f["pending"] for fragments in per.values() for f in fragments)
    if args.json:
        out: dict[str, Any] = {"pending": pending, "fragments": [f for fs in per.values() for f in fs]}
        if len(per) > 1:
            out["clusters"] = {name: {"pending": sum(f["pending"] for f in fs), "fragments": fs} for name, fs in per.items()}
        print(json.dumps(out, indent=2))
        return
    print(f"{pending} delayed messages waiting")
    now = int(time.time() * 1000)
    for name, fragments in per.items():
        where = f" on cluster {name}" if len(per) > 1 else ""
        for f in fragments:
            due = (f["next_due_ms"] - now) / 1000
            when = f"next due in {due:.1f}s" if due > 0 else f"next overdue by {-due:.1f}s"
            print(f"  fragment {f['fragment']}{where}: {f['pending']} waiting, {when}")


def cmd_clients(args: argparse.Namespace) -> None:
    clients = admin_get(args, "clients").get("clients")
    if not isinstance(clients, list):
        raise CliError(f"http://{args.http_address}/admin/clients answered no list of clients", 3)
    if args.json:
        print(json.dumps(clients, indent=2))
        return
    print(f"{len(clients)} clients")
    for c in clients:
        if c["protocol"] == "dmq":
            subs = ", ".join(f"{s['topic']}/{s['channel']} ({s['in_flight']}/{s['credit']})" for s in c["subscriptions"])
            print(f"  dmq {c['remote_address']}: {subs or 'producer'}")
        else:
            print(f"  nsq {c.get('remote_address')}: {c.get('client_id') or c.get('hostname') or ''} {c.get('state')}")


def _when(ms: int | None) -> str:
    if not ms:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}"


def cmd_trace(args: argparse.Namespace) -> None:
    """A message's life from the stored facts (what a running node holds in memory right
    now is the admin API's ``/admin/messages/ID``)."""
    from dmq_server.admin.inspect import describe_event
    from dmq_server.db.trace_steps import find_message_steps, read_trace_steps

    message_id = args.id
    if message_id is None:
        if not args.producer or args.session_id is None:
            raise CliError("give a message id, or --producer and --session-id", 2)
        with open_clusters(args) as conns:  # the producer's topic may be on any cluster
            found = [m for m in (run_steps(conn, find_message_steps(args.producer, args.session_id))
                                  for conn in conns.values()) if m]
        if not found:
            raise CliError(f"no message stored for producer {args.producer!r} and session id {args.session_id}", 1)
        message_id = found[0]
    args.cluster = cluster_of_id(args, message_id)  # the id names its cluster
    with open_clusters(args) as conns:
        trace = run_steps(next(iter(conns.values())), read_trace_steps(message_id))
    if args.json:
        print(json.dumps(trace, indent=2))
        return
    delayed = trace["delayed"]
    if not trace["found"] and delayed is None:
        raise CliError(f"no message {message_id}: not stored, logged or delayed "
                       "(swept after --message-retention unless the archive keeps it)", 1)
    if delayed is not None:
        print(f"delay entry {message_id}: {delayed['topic']}, due {_when(delayed['due_ms'])} UTC "
              f"(producer {delayed['producer']}, session {delayed['session_id']}, {delayed['size']} bytes)")
        for line in _properties_lines(delayed):
            print(line)
        return
    stored = trace["stored"]
    if stored is not None:
        swept = ", swept (kept for the archive)" if stored["swept"] else ""
        print(f"message {message_id} on topic {stored['topic']}, {stored['size']} bytes{swept}")
        for line in _properties_lines(stored):
            print(line)
    else:
        print(f"message {message_id} on topic {trace['topic']} (the stored message was swept after its retention)")
    if trace["replay_of"]:
        r = trace["replay_of"]
        print(f"  a replay of dead letter {r['dead_letter_id']} ({r['reason']}, message {r['message_id'] or '-'})")
    for event in trace["events"]:
        print(f"  {_when(event['at_ms'])}  {describe_event(event)}")
    for p in trace["pending"]:
        print(f"  waiting on {p['channel']}: {p['attempts']} attempts recorded, owner {p['owner'] or '?'}")


def cmd_peek(args: argparse.Namespace) -> None:
    """A channel's waiting messages, oldest first, read without consuming them."""
    from dmq_server.db.trace_steps import peek_channel_steps

    if not 1 <= args.limit <= 500:
        raise CliError("--limit must be 1..500", 2)
    from registry.pg import topics

    with open_database(args) as conn:
        placed = {t.name: t for t in topics(conn)}.get(args.topic)
    args.cluster = placed.cluster if placed is not None else "main"  # the topic's cluster holds its copies
    with open_clusters(args) as conns:
        rows = run_steps(next(iter(conns.values())),
                         peek_channel_steps(args.topic, args.channel, args.after, args.limit, preview=args.bytes))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        print(f"nothing waiting on {args.topic}/{args.channel}")
        return
    print("message	published (UTC)	attempts	owner	bytes	key	priority	headers	body")
    for r in rows:
        body = r["body"] if r["body_encoding"] == "utf-8" else "(base64) " + r["body"]
        print(f"{r['message_id']}	{_when(r['published_ms'])}	{r['attempts']}	{r['owner']}	{r['size']}	"
              f"{_properties_columns(r)}	{body!r}{'...' if r['truncated'] else ''}")


def _add_filters(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topic")
    p.add_argument("--channel")
    p.add_argument("--reason", help="rate_limited, storage_failure, expired, max_attempts, client_reported, operator")
    p.add_argument("--since", help="dead at or after: Unix ms, ISO 8601 or a duration ago (15m, 2h, 7d)")
    p.add_argument("--until", help="dead before: Unix ms, ISO 8601 or a duration ago")
    p.add_argument("--ids", dest="ids_opt", action="append", metavar="ID,ID...", help="dead letter ids")
    p.add_argument("--message-ids", metavar="ID,ID...", help="original message ids")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--replayed", dest="replayed", action="store_true", default=None)
    group.add_argument("--not-replayed", dest="replayed", action="store_false")


def add_admin_commands(sub: Any) -> None:
    dlq = sub.add_parser("dlq", help="dead letters: list, show, replay, delete")
    dsub = dlq.add_subparsers(dest="action", required=True)
    lst = dsub.add_parser("list", help="list dead letters (filters combine with AND)")
    _add_filters(lst)
    lst.add_argument("--limit", default="100", help="at most this many (default 100)")
    lst.add_argument("--after", type=int, default=0, metavar="ID", help="only ids above this (paging)")
    lst.add_argument("--json", action="store_true")
    show = dsub.add_parser("show", help="one dead letter with its key, priority, headers and body")
    show.add_argument("id", type=int)
    for action, text in (("replay", "put dead letters back into the reliable flow, each for its channel"),
                         ("delete", "remove dead letters")):
        p = dsub.add_parser(action, help=text)
        p.add_argument("id_list", nargs="*", type=int, metavar="ID", help="dead letter ids")
        _add_filters(p)
        p.add_argument("--all", action="store_true", help="every dead letter (needed without ids or filters)")
        p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help=f"per transaction (default {DEFAULT_BATCH})")
        p.add_argument("--quiet", action="store_true", help="no progress lines")
        if action == "replay":
            p.add_argument("--delay-fragments", type=int, default=8,
                           help="the servers' --delay-fragments (default 8)")
    for p in (lst, *[dsub.choices[a] for a in ("replay", "delete")]):
        p.add_argument("--cluster", default=None,
                       help="only this PostgreSQL cluster (default: main and every --pg-cluster given)")
    dlq.set_defaults(func=cmd_dlq)

    delay = sub.add_parser("delay", help="delayed messages")
    delsub = delay.add_subparsers(dest="action", required=True)
    stats = delsub.add_parser("stats", help="waiting delayed messages per fragment")
    stats.add_argument("--json", action="store_true")
    stats.add_argument("--cluster", default=None,
                       help="only this PostgreSQL cluster (default: main and every --pg-cluster given)")
    delay.set_defaults(func=cmd_delay)

    trace = sub.add_parser("trace", help="a message's life: stored, each delivery and why it came back, "
                           "the ack or the dead letter")
    trace.add_argument("id", type=int, nargs="?", help="the message id (SEND_SUCCESS_ACK's, or NSQ's in decimal)")
    trace.add_argument("--producer", help="find the message by its producer ...")
    trace.add_argument("--session-id", type=int, help="... and session id")
    trace.add_argument("--json", action="store_true")
    trace.set_defaults(func=cmd_trace)

    peek = sub.add_parser("peek", help="a channel's waiting messages, oldest first, without consuming them")
    peek.add_argument("topic")
    peek.add_argument("channel")
    peek.add_argument("--limit", type=int, default=20, help="at most this many (default 20, at most 500)")
    peek.add_argument("--after", type=int, default=0, metavar="ID", help="only ids above this (paging)")
    peek.add_argument("--bytes", type=int, default=200, help="body bytes shown (default 200)")
    peek.add_argument("--json", action="store_true")
    peek.set_defaults(func=cmd_peek)

    clients = sub.add_parser("clients", help="clients connected to a running server (its HTTP admin API)")
    clients.add_argument("--admin-token", default=os.environ.get("DMQ_ADMIN_TOKEN"), help="the server's --admin-token (env DMQ_ADMIN_TOKEN)")
    clients.add_argument("--json", action="store_true")
    clients.set_defaults(func=cmd_clients)

"""The in-memory double answers as PostgreSQL does: one script, two databases.

The same steps (the server's own: ``db.messages``, ``db.dead_letter_steps``, ``db.topic_steps``,
``db.delays``, ``db.admin_steps``, ``db.trace_steps``, ``db.takeover_steps``, ``db.orderer_steps``,
``db.clusters``) run in the
same order on ``MemoryDb`` and on a migrated PostgreSQL (autocommit, as the writers run
them), and every answer must be equal once the values that differ by nature are made
comparable: ids (of messages, dead letters, delayed messages) become their order of
first appearance and timestamps only have to be "now". If a statement of
``sql/queries.sql`` changes what it answers, this test fails until
``dmq_server/db/memory.py`` follows, so the unit tests built on the double (broker,
protocols, admin operations, trace, delays, takeover) cannot drift from the SQL
silently; and ``test_every_statement_has_a_handler_and_a_case`` fails naming any
statement that has no handler or that no script here runs.
"""

from __future__ import annotations

import dataclasses
import random
import time
from datetime import datetime
from typing import Any, Callable

import psycopg

import registry
from dmq_client.wire.properties import NO_PROPERTIES, Properties
from dmq_server.db.dead_letter_steps import (
    CopyRef,
    NewDeadLetter,
    exhaust_deliveries_steps,
    insert_dead_letters_steps,
    record_attempts_steps,
)
from dmq_server.db.admin_steps import (
    count_dead_letters_steps,
    dead_letter_counts_steps,
    delete_batch_steps,
    list_admin_log_steps,
    list_dead_letters_steps,
    log_operation_steps,
    replay_batch_steps,
    show_dead_letter_steps,
    stored_stats_steps,
    topic_leftovers_steps,
    update_topic_settings_steps,
)
from dmq_server.db.confirm_steps import consumed_states_steps
from dmq_server.db.clusters import ClusterMismatch, assign_slots_steps, claim_cluster_steps
from dmq_server.db.dead_letter_steps import expire_deliveries_steps, open_ttl_cursors_steps
from dmq_server.db.delays import (
    NewDelayed,
    cancel_delayed_steps,
    deliver_delayed_now_steps,
    delay_stats_steps,
    due_histogram_steps,
    insert_delayed_steps,
    list_delayed_steps,
    move_due_steps,
    peek_delayed_steps,
)
from dmq_server.db.storage_errors import Fenced, StorageError
from dmq_server.db.memory import MIGRATOR_STATEMENTS, MemoryDb
from dmq_server.db.messages import (
    AckRow,
    CursorProgress,
    NewMessage,
    ack_deliveries_steps,
    backends_alive_steps,
    create_owner_steps,
    empty_channel_steps,
    owner_heartbeat_steps,
    insert_messages_steps,
    read_owners_steps,
    retire_silent_owners_steps,
    load_backlog_steps,
    load_priority_backlog_steps,
    read_channel_state_steps,
    depth_slice_steps,
    run_query_steps,
    MAX_ID,
    SweepTarget,
    sweep_all_steps,
    sweep_plan_steps,
    sweep_topic_steps,
)
from dmq_server.db.orderer_steps import claim_ordered_cursors_steps, release_ordered_cursors_steps
from dmq_server.db.schema import migrate, ping_steps
from dmq_server.db.seek import SeekRefused, SeekTarget, Sought, ToId, ToLatest, ToTime, seek_bounds_steps, seek_channel_steps
from dmq_server.db.retained import SettlePoint, count_plan_steps, count_topic_steps, retained_figures_steps
from dmq_server.db.steps import STATEMENTS, Statement, Steps, run_steps
from dmq_server.db.takeover_steps import claim_owners_steps, owner_depths_steps, takeover_candidates_steps
from dmq_server.db.topic_steps import list_topics_steps, mirror_topics_steps
from dmq_server.db.trace_steps import (
    ReturnRow,
    find_message_steps,
    peek_channel_steps,
    read_gauges_steps,
    read_trace_steps,
    record_returns_steps,
    sweep_trace_steps,
)
from registry.model import TopicSpec
from dmq_server.db.worker import connect

NODE = "node-1"
OWNER = 1  # the first incarnation of a fresh database


def _msg(producer: str, session_id: int, topic: str = "orders", body: bytes | None = None,
         props: Properties = NO_PROPERTIES) -> NewMessage:
    return NewMessage(topic, producer, session_id, 0, body if body is not None else f"{producer}{session_id}".encode(),
                      props)


PROPS = Properties(key="k-1", priority=7, headers={"content-type": "text/plain", "tenant": "été"})


def find_steps(pairs: list[tuple[str, int]]) -> Steps:
    rows = yield Statement("find_messages", {"producers": [p for p, _ in pairs], "session_ids": [s for _, s in pairs]})
    return sorted(rows, key=lambda r: (r[1], r[2]))


def insert_new_steps(batch: list[NewMessage], name: str = "insert_new_messages", owner: int = OWNER) -> Steps:
    """The fast insert alone: a stored pair (or, of outbox rows, a recorded one) must fail
    it as a unique violation."""
    params = {
        "topics": [m.topic for m in batch], "producers": [m.producer for m in batch],
        "session_ids": [m.session_id for m in batch], "produced_ms": [0] * len(batch),
        "bodies": [m.body for m in batch], "node_id": NODE, "owner": owner,
        "batch_topics": sorted({m.topic for m in batch}),
    }
    try:
        rows = yield Statement(name, params, may_fail=True)
    except psycopg.errors.UniqueViolation:
        return "unique violation"
    return len(rows)


def ack_new_steps(*args: Any) -> Steps:
    """The fast ack alone: a repeat among its acks must fail it whole, as a division by zero."""
    first = next(ack_deliveries_steps(*args))
    assert first.name == "ack_new_deliveries", first.name
    try:
        rows = yield Statement(first.name, first.params, may_fail=True)
    except psycopg.errors.DivisionByZero:
        return "division by zero"
    return [tuple(row) for row in rows]


def ack(channel: str, message_id: int) -> AckRow:
    return AckRow("orders", channel, message_id, 1_700_000_000_000, 1_700_000_001_000, 1, owner=OWNER)


def cursor(channel: str, floor: int, *spans: tuple[int, int]) -> list[CursorProgress]:
    return [CursorProgress("orders", channel, OWNER, floor, list(spans))]


class Ids:
    """Ids (of messages: ``m``, dead letters, delayed messages) as the order they were
    first seen in (the sequences differ)."""

    def __init__(self, prefix: str = "m") -> None:
        self.prefix = prefix
        self._alias: dict[int, str] = {}
        self.real: dict[str, int] = {}

    def __call__(self, message_id: int | None) -> str | None:
        if message_id is None:
            return None
        alias = self._alias.setdefault(message_id, f"{self.prefix}{len(self._alias) + 1}")
        self.real[alias] = message_id
        return alias


def now_ish(ms: int) -> bool:
    return abs(ms - time.time() * 1000) < 120_000


def comparable(value: Any, ids: Ids) -> Any:
    if dataclasses.is_dataclass(value):
        fields = dataclasses.asdict(value)
        if "message_id" in fields:
            fields["message_id"] = ids(fields["message_id"])
        if "published_ms" in fields:
            fields["published_ms"] = now_ish(fields["published_ms"])
        return {k: comparable(v, ids) if isinstance(v, (list, tuple)) else v for k, v in fields.items()}
    if isinstance(value, list):
        return [comparable(v, ids) for v in value]
    return value


def script(ids: Ids) -> list[tuple[str, Callable[..., Steps], Callable[[], tuple], Callable[[Any], Any]]]:
    def depth_slice_view(s: tuple) -> tuple:  # (high, counts, lowest ids made comparable)
        return s[1], s[2], {key: ids(message_id) for key, message_id in s[3].items()}

    """(label, steps, arguments (late: they may name ids seen before), view of the answer)."""
    same = lambda v: comparable(v, ids)  # noqa: E731
    seek_view = lambda v: sought_view(v, ids)  # noqa: E731
    m = ids.real
    return [
        ("topics", list_topics_steps, lambda: (), same),
        ("an incarnation", create_owner_steps, lambda: (NODE,), same),
        ("first batch", insert_messages_steps, lambda: ([_msg("p", 1), _msg("p", 2), _msg("a", 9)], NODE, OWNER), same),
        ("a stored pair fails the fast insert", insert_new_steps, lambda: ([_msg("p", 2), _msg("p", 5)],), same),
        ("nothing of it was stored", find_steps, lambda: ([("p", 5)],), same),
        (
            "a batch with a resend, a new pair twice, a topic without channels",
            insert_messages_steps,
            lambda: ([_msg("p", 2), _msg("p", 3), _msg("p", 3), _msg("q", 1, topic="quiet")], NODE, OWNER),
            same,
        ),
        (
            "find",
            find_steps,
            lambda: ([("p", 1), ("p", 3), ("nobody", 1)],),
            lambda rows: [(ids(r[0]), r[1], r[2], now_ish(r[3])) for r in rows],
        ),
        (
            "ack (twice in one batch)",
            ack_deliveries_steps,
            lambda: ([ack("billing", m["m1"]), ack("billing", m["m1"])], cursor("billing", 0, (m["m1"], m["m1"])), NODE),
            same,
        ),
        ("a repeat fails the fast ack", ack_new_steps, lambda: ([ack("billing", m["m1"])], cursor("billing", 0), NODE), same),
        ("ack of a copy already done", ack_deliveries_steps, lambda: ([ack("billing", m["m1"])], cursor("billing", 0), NODE), same),
        (
            "an ack out of order: a span above the floor",
            ack_deliveries_steps,
            lambda: ([ack("billing", m["m4"])], cursor("billing", 0, (m["m4"], m["m4"])), NODE),
            same,
        ),
        ("a floor below the cursor's changes nothing", ack_deliveries_steps, lambda: ([], cursor("billing", 0), NODE), same),
        (
            "in a cluster, another node's ack of a cursor it does not hold is fenced",
            ack_deliveries_steps,
            lambda: ([ack("billing", m["m2"])], cursor("billing", 0, (m["m2"], m["m2"])), "node-2", True),
            same,
        ),
        ("backlog", load_backlog_steps, lambda: ("orders", "billing", 0, 10), same),
        ("backlog after a cursor, limited", load_backlog_steps, lambda: ("orders", "audit", m["m1"], 1), same),
        ("backlog of this node's incarnation", load_backlog_steps, lambda: ("orders", "audit", 0, 10, NODE, OWNER), same),
        ("backlog of another node", load_backlog_steps, lambda: ("orders", "audit", 0, 10, "node-2", 2), same),
        ("pauses and retired incarnations", read_channel_state_steps, lambda: (), lambda s: (sorted(s[0]), sorted(s[1]))),
        # the depth count's slices: what each counts, and whether the pass is complete
        ("depths, a pass of one slice", depth_slice_steps, lambda: (None, 1000), depth_slice_view),
        ("depths, a first slice of one message", depth_slice_steps, lambda: (None, 1), lambda s: (s[1] is None, *depth_slice_view(s)[1:])),
        ("depths, the slices above a message", depth_slice_steps, lambda: (m["m1"], 1000),
         lambda s: (s[1] is None, *depth_slice_view(s)[1:])),
        ("pause", run_query_steps, lambda: ("pause_channel", {"topic": "orders", "channel": "billing"}), same),
        ("pause again", run_query_steps, lambda: ("pause_channel", {"topic": "orders", "channel": "billing"}), same),
        ("paused", read_channel_state_steps, lambda: (), lambda s: sorted(s[0])),
        ("unpause", run_query_steps, lambda: ("unpause_channel", {"topic": "orders", "channel": "billing"}), same),
        (
            "record attempts",
            record_attempts_steps,
            lambda: ([CopyRef("orders", "billing", m["m2"], 3, OWNER), CopyRef("orders", "billing", m["m1"], 3, OWNER)],),
            same,
        ),
        ("attempts are loaded", load_backlog_steps, lambda: ("orders", "billing", 0, 10), same),
        (
            "returned deliveries for the trace",
            record_returns_steps,
            lambda: ([ReturnRow(m["m2"], "orders", "billing", 2, "timeout", "nsq a@h:1", 1_000, 2_000),
                      ReturnRow(m["m2"], "orders", "billing", 3, "requeued", "", 3_000, 3_500)], NODE),
            same,
        ),
        (
            "exhaust",
            exhaust_deliveries_steps,
            lambda: ([CopyRef("orders", "billing", m["m2"], 2, OWNER), CopyRef("orders", "audit", 999_999_999, 2, OWNER)], NODE),
            lambda rows: [(t, c, ids(i)) for t, c, i in rows],
        ),
        (
            "in a cluster, another node's exhaust of a cursor it does not hold is fenced",
            exhaust_deliveries_steps,
            lambda: ([CopyRef("orders", "billing", m["m3"], 2, OWNER)], "node-2", True),
            lambda rows: [(t, c, ids(i)) for t, c, i in rows],
        ),
        ("after the exhaust", load_backlog_steps, lambda: ("orders", "billing", 0, 10), same),
        # a producer's confirmation: acked (m1, m4 on billing), dead (m2 on billing), waiting
        # (audit), and an id no longer stored (swept: every channel was done with it)
        ("consumed states", consumed_states_steps,
         lambda: ([(m["m1"], "orders"), (m["m2"], "orders"), (m["m4"], "orders"), (999_999_999, "orders")],),
         lambda rows: [("gone" if i == 999_999_999 else ids(i), c, state) for i, c, state in rows]),
        ("empty a channel", empty_channel_steps, lambda: ("orders", "audit"), same),
        ("empty it again", empty_channel_steps, lambda: ("orders", "audit"), same),
        ("a second incarnation", create_owner_steps, lambda: (NODE,), same),
        ("it retires the first", retire_silent_owners_steps, lambda: (OWNER + 1, NODE, 3600), same),
        ("incarnations", read_owners_steps, lambda: (), lambda rows: [(r.owner, r.node_id, r.retired) for r in rows]),
        ("a retired incarnation stores nothing", insert_messages_steps, lambda: ([_msg("z", 1)], NODE, OWNER), lambda e: type(e).__name__),
        (
            "dead letters",
            insert_dead_letters_steps,
            lambda: ([NewDeadLetter("rate_limited", "orders", "p", 7, b"x"), NewDeadLetter("client_reported", "orders", "p", 8, b"y")],),
            lambda new_ids: len(new_ids) == 2 and new_ids[0] < new_ids[1],
        ),
        ("depths at the end", depth_slice_steps, lambda: (None, 1000), depth_slice_view),
        ("nothing old enough to sweep", sweep_all_steps, lambda: (3600, 100), same),
        ("a sweep's plan: every topic stored, each with its retention (issue 46)", sweep_plan_steps,
         lambda: (-60, {}), lambda out: ([(t.topic, t.retention_s, t.below) for t in out[0]], {r: n > 0 for r, n in out[1].items()})),
        # the retained figures (schema 22): a count's plan, a full batch, the rest, a topic
        # neither registered nor stored (its figures go at once)
        ("a count's plan: the topics stored and counted (issue 46)", count_plan_steps, lambda: (-60_000,),
         lambda out: (out[0].upto is not None, out[1])),
        ("count orders: a full batch", count_topic_steps, lambda: ("orders", SettlePoint(MAX_ID, 1), 2), same),
        ("count orders: the rest", count_topic_steps, lambda: ("orders", SettlePoint(MAX_ID, 1), 100), same),
        ("count a topic neither registered nor stored", count_topic_steps,
         lambda: ("ghost", SettlePoint(None, 5), 100), same),
        ("the retained figures", retained_figures_steps, lambda: (), same),
        ("sweep orders: copies acknowledged out of order too (issue 46)", sweep_topic_steps,
         lambda: (SweepTarget("orders", -60, MAX_ID), 100), lambda out: (out[0], out[1] > 0)),
        ("sweep what no channel holds", sweep_all_steps, lambda: (-60, 100), same),
        ("the retained figures less what the sweeps removed", retained_figures_steps, lambda: (), same),
        ("swept", find_steps, lambda: ([("p", 1), ("p", 2), ("p", 3), ("a", 9), ("q", 1)],), lambda rows: [(r[1], r[2]) for r in rows]),
        # outbox rows (a relay's producers) are recorded as they are stored, and a recorded
        # one is never stored again, also once its message was swept (schema version 15)
        ("outbox rows among others", insert_messages_steps,
         lambda: ([_msg(OUTBOX, 1, "quiet"), _msg(OUTBOX, 2, "quiet"), _msg("r", 1, "quiet")], NODE, OWNER + 1), same),
        ("a recorded outbox row fails the fast insert", insert_new_steps,
         lambda: ([_msg(OUTBOX, 2, "quiet"), _msg(OUTBOX, 3, "quiet")], "insert_new_outbox_messages", OWNER + 1), same),
        ("a repeat of a recorded outbox row is a resend", insert_messages_steps,
         lambda: ([_msg(OUTBOX, 2, "quiet"), _msg(OUTBOX, 3, "quiet")], NODE, OWNER + 1), same),
        # one topic's sweep (issue 46): quiet has no channel, so every stored row of it is done;
        # the rows of other topics stay (orders' waiting copies among them)
        ("sweep one topic (quiet: no channel)", sweep_topic_steps, lambda: (SweepTarget("quiet", -60, MAX_ID), 100),
         lambda out: (out[0], out[1] > 0)),
        ("swept only quiet", find_steps, lambda: ([(OUTBOX, 1), (OUTBOX, 3), ("r", 1), ("p", 4), ("a", 9)],),
         lambda rows: [(r[1], r[2]) for r in rows]),
        ("sweep the outbox rows", sweep_all_steps, lambda: (-60, 100), same),
        ("a swept outbox row's repeat fails the fast insert (its record)", insert_new_steps,
         lambda: ([_msg(OUTBOX, 1, "quiet"), _msg("r", 3, "quiet")], "insert_new_outbox_messages", OWNER + 1), same),
        ("a repeat of a swept outbox row is not stored", insert_messages_steps,
         lambda: ([_msg(OUTBOX, 1, "quiet"), _msg("r", 2, "quiet")], NODE, OWNER + 1),
         lambda out: [type(s).__name__ for s in out]),
        ("nothing of the repeat stored", find_steps, lambda: ([(OUTBOX, 1), ("r", 2)],), lambda rows: [(r[1], r[2]) for r in rows]),
        ("outbox rows with properties", insert_messages_steps,
         lambda: ([_msg(OUTBOX, 7, "quiet", props=PROPS)], NODE, OWNER + 1), same),
        ("their repeat with properties", insert_messages_steps,
         lambda: ([_msg(OUTBOX, 7, "quiet", props=PROPS), _msg(OUTBOX, 8, "quiet", props=PROPS)], NODE, OWNER + 1),
         same),
        # properties (schema 16): a batch with some runs the _props statements
        ("a batch with properties", insert_messages_steps, lambda: ([_msg("k", 1, props=PROPS), _msg("k", 2)], NODE, OWNER + 1),
         same),
        ("a resend among properties", insert_messages_steps,
         lambda: ([_msg("k", 2, props=PROPS), _msg("k", 3, props=Properties(priority=1))], NODE, OWNER + 1), same),
        ("the backlog with properties", load_backlog_steps, lambda: ("orders", "billing", 0, 100), same),
        # an ordered topic's channel reads a key with many copies waiting apart (ChannelCursor.skipped)
        ("the backlog without a key read apart", load_backlog_steps,
         lambda: ("orders", "billing", 0, 100, None, 0, ["k-1"]), same),
        ("the backlog of one key", load_backlog_steps, lambda: ("orders", "billing", 0, 100, None, 0, (), "k-1"), same),
        # the copies of a priority above 0 (k1: 7, k3: 1), highest first (test_priority_backlog.py: the rest)
        ("the priority backlog", load_priority_backlog_steps, lambda: ("orders", "billing", [0] * 9, 100), same),
        # a dead letter keeps its message's properties: a copy past its attempts, one past its ttl
        ("a copy with properties exhausted", exhaust_pair_steps, lambda: ("k", 1, "orders", "billing", OWNER + 1),
         lambda rows: [(t, c, ids(i)) for t, c, i in rows]),
        ("a message with properties on a topic with a time to live", insert_messages_steps,
         lambda: ([_msg("t", 1, topic="short", props=PROPS)], NODE, OWNER + 1), same),
        ("its cursors opened", open_ttl_cursors_steps, lambda: (), same),
        # in a cluster a node expires only the copies of cursors it holds
        ("a node holding none of its cursors expires nothing", expire_deliveries_steps,
         lambda: (int(time.time() * 1000) + 60_000, 10, "node-9", True), same),
        ("it expires", expire_deliveries_steps, lambda: (int(time.time() * 1000) + 60_000, 10),
         lambda rows: [(t, c, ids(i)) for t, c, i in rows]),
        ("the dead letters with their properties", list_dead_letters_steps, lambda: (EVERY, 10, 0),
         lambda rows: [(r["reason"], r["producer"], r["session_id"], ids(r["message_id"]), r["key"], r["priority"],
                        r["headers"], list(r["headers"] or ())) for r in rows]),
        # a seek (issue 46): every cursor of the channel written anew (orders was swept above:
        # its retained start is where its sweep got to)
        ("a seek's dry run to the latest", seek_or_refusal_steps, lambda: ("orders", "billing", ToLatest(), True),
         seek_view),
        ("k2 delivered three times on both channels", attempts_pair_steps, lambda: ("k", 2, OWNER + 1), same),
        ("a seek to the id of k2", seek_pair_steps, lambda: ("k", 2, "billing"), seek_view),
        ("what billing waits for after it", load_backlog_steps, lambda: ("orders", "billing", 0, 100), same),
        ("audit is untouched", load_backlog_steps, lambda: ("orders", "audit", 0, 100), same),
        ("a dry run to k1", seek_pair_steps, lambda: ("k", 1, "billing", True), seek_view),
        ("a seek to the latest", seek_or_refusal_steps, lambda: ("orders", "billing", ToLatest()), seek_view),
        ("billing waits for nothing", load_backlog_steps, lambda: ("orders", "billing", 0, 100), same),
        ("a seek of short's channel to its first id: its expired copy waits again", seek_or_refusal_steps,
         lambda: ("short", "c", ToId(1)), seek_view),
        ("a channel registered after the messages", rows_steps, lambda: ("add_channel", {"topic": "orders", "name": "late"}),
         same),
        ("it is sought back to k1", seek_pair_steps, lambda: ("k", 1, "late"), seek_view),
        ("what it waits for", load_backlog_steps, lambda: ("orders", "late", 0, 100), same),
        ("by holder after the seeks", owner_depths_steps, lambda: (), same),
        ("a seek before the retained start", seek_or_refusal_steps, lambda: ("orders", "billing", ToTime(0)), same),
        ("a seek to an id swept", seek_or_refusal_steps, lambda: ("orders", "billing", ToId(1)), same),
        ("a seek into the future", seek_or_refusal_steps,
         lambda: ("orders", "billing", ToTime(int(time.time() * 1000) + 60_000)), same),
        ("a seek of no channel", seek_or_refusal_steps, lambda: ("orders", "nobody", ToLatest()), same),
        ("the ids around a time before everything", seek_bounds_steps, lambda: (int(time.time() * 1000) - 3_600_000,),
         lambda b: (ids(b.lo), ids(b.hi))),
    ]


def attempts_pair_steps(producer: str, session_id: int, owner: int) -> Steps:
    """Three attempts kept for the copies on billing and audit of the message stored as the pair."""
    ((message_id, *_),) = yield Statement("find_messages", {"producers": [producer], "session_ids": [session_id]})
    return (yield from record_attempts_steps([CopyRef("orders", c, message_id, 3, owner) for c in ("billing", "audit")]))


def seek_or_refusal_steps(topic: str, channel: str, target: SeekTarget, dry_run: bool = False) -> Steps:
    """A seek, or the name of its refusal."""
    try:
        return (yield from seek_channel_steps(topic, channel, target, dry_run))
    except SeekRefused as exc:
        return type(exc).__name__


def seek_pair_steps(producer: str, session_id: int, channel: str, dry_run: bool = False) -> Steps:
    """A seek of ``channel`` of orders to the id of the message stored as the pair."""
    ((message_id, *_),) = yield Statement("find_messages", {"producers": [producer], "session_ids": [session_id]})
    return (yield from seek_or_refusal_steps("orders", channel, ToId(message_id), dry_run))


def sought_view(s: Sought | str, ids: Ids) -> Any:
    """A seek's answer with its ids by order, its times by whether they are set (the
    target by its kind: its id differs)."""
    if isinstance(s, str):
        return s
    return (type(s.target).__name__, s.count, ids(s.top), ids(s.target_id), s.target_ms is not None, s.epoch,
            ids(s.previous_id), s.previous_ms is not None)


def exhaust_pair_steps(producer: str, session_id: int, topic: str, channel: str, owner: int) -> Steps:
    """exhaust_deliveries of the copy on ``channel`` of the message stored as the pair."""
    ((message_id, *_),) = yield Statement("find_messages", {"producers": [producer], "session_ids": [session_id]})
    return (yield from exhaust_deliveries_steps([CopyRef(topic, channel, message_id, 2, owner)], NODE))


def ack_pair_steps(producer: str, session_id: int, topic: str, owner: int, node: str) -> Steps:
    """``node`` acknowledges on channel ``c`` the message stored as the pair, in a cluster
    (fenced): the cursors it does not hold, which did not move. The statement as written
    (the fast one fails on a fenced ack, and a failure inside the script's transactions
    would end them)."""
    ((message_id, *_),) = yield Statement("find_messages", {"producers": [producer], "session_ids": [session_id]})
    acks = [AckRow(topic, "c", message_id, 1_700_000_000_000, 1_700_000_001_000, 1, owner=owner)]
    progress = [CursorProgress(topic, "c", owner, 0, [(message_id, message_id)])]
    fast = next(ack_deliveries_steps(acks, progress, node, True))
    return [tuple(row) for row in (yield Statement("ack_deliveries", fast.params))]


OUTBOX = "outbox:shop:0000abcd"  # a relay's producer (core.outbox_rows.producer_of)


def rows_steps(name: str, params: dict[str, Any], count: bool = False) -> Steps:
    """One statement as it is (a statement the server runs inside steps of its own, or
    the registry's), its rows; a refusal as the name of its error."""
    try:
        return (yield Statement(name, params, may_fail=True, count=count))
    except psycopg.Error as exc:
        return type(exc).__name__


class Kinds:
    """The ids of each kind, and the normaliser of answers made of dicts and dataclasses:
    ids by their kind (the key names it), timestamps of now as "now"."""

    def __init__(self) -> None:
        self.m, self.d, self.y = Ids("m"), Ids("d"), Ids("y")

    def __call__(self, value: Any, id_kind: str = "") -> Any:
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        if isinstance(value, dict):
            out = {k: self._field(k, v, id_kind) for k, v in value.items()}
            if value.get("producer") == "dmq-replay":  # a replay's session id is its dead letter's id
                out["session_id"] = self.d(value["session_id"])
            return out
        if isinstance(value, (list, tuple)):
            return type(value)(self(v, id_kind) for v in value)
        if isinstance(value, datetime):
            return "now" if now_ish(int(value.timestamp() * 1000)) else value
        return value

    def _field(self, key: str, value: Any, id_kind: str) -> Any:
        kind = {"message_id": self.m, "replay_message_id": self.m, "dead_letter_id": self.d, "replay_of": self.d,
                "delay_id": self.y, "id": getattr(self, id_kind, None) if id_kind else None}.get(key)
        if kind is not None and (value is None or isinstance(value, int)):
            return kind(value)
        if isinstance(key, str) and key.endswith("_ms"):
            if isinstance(value, int) and now_ish(value):
                return "now"
            if isinstance(value, dict):  # times by key
                return {kk: self._field(key, vv, "") for kk, vv in value.items()}
        if isinstance(value, (dict, list, tuple)) or dataclasses.is_dataclass(value):
            return self(value, "")
        return value


#: the filter that selects every dead letter
EVERY = {"topic": None, "channel": None, "reason": None, "since_ms": None, "until_ms": None, "ids": None,
         "message_ids": None, "replayed": None}
LONG_AGO = 1_000  # due times and return times in 1970: before any "now"
#: a dead letter's properties: a key, a priority, headers (a name with a dot, a value beyond ASCII)
LETTER_PROPERTIES = Properties("order-7", 5, {"content-type": "application/json", "x.trace": "caf\u00e9"})
LATER = 4_000_000_000_000  # a due time in 2096


ZK_EPOCH = 1_764_000_000_000  # a ZooKeeper registry's epoch (/dmq/topic's ctime, ms)


def _specs(*extra: TopicSpec) -> list[TopicSpec]:
    return [TopicSpec("orders", channels=("audit", "billing")), TopicSpec("quiet", msg_timeout_ms=30000, rate_limit=5),
            TopicSpec("short", ttl_ms=1, channels=("c",)), *extra]


def operators_script(k: Kinds) -> list[tuple[str, Callable[..., Steps], Callable[[], tuple], Callable[[Any], Any]]]:
    """The statements of the admin surfaces, the trace, the delay workers, the expiry, the
    takeover, the registry's mirror and the clusters: (label, steps, arguments, view)."""
    same = lambda v: k(v)  # noqa: E731
    m, d, y = k.m.real, k.d.real, k.y.real
    letters = lambda v: k(v, "d")  # noqa: E731
    # the ids a move draws follow its plan's order: named in the order of the pairs
    moved_view = lambda out: (out[0], [k(x) for x in sorted(out[1], key=lambda x: (x.producer, x.session_id))])  # noqa: E731
    # a read of ZooKeeper: a version above every one the tables' own statements give
    extra = TopicSpec("extra", msg_timeout_ms=5000, rate_limit=9, channels=("one",), version=(ZK_EPOCH, 10))
    return [
        ("ping", ping_steps, lambda: (), same),
        # the registry: what a node mirrors from ZooKeeper, and the CLI's own statements
        ("create an ordered topic kept a week", rows_steps, lambda: ("create_topic", {"name": "extra",
         "store": "reliable", "msg_timeout_ms": 1000, "rate_limit": None, "ttl_ms": None, "max_attempts": None,
         "cluster": "main", "ordered": True, "retention_ms": 604_800_000}), same),
        ("create it again", rows_steps, lambda: ("create_topic", {"name": "extra", "store": "reliable", "msg_timeout_ms": 1000,
         "rate_limit": None, "ttl_ms": None, "max_attempts": None, "cluster": "main", "ordered": False,
         "retention_ms": None}), same),
        ("it is listed ordered", list_topics_steps, lambda: (), same),
        ("a channel", rows_steps, lambda: ("add_channel", {"topic": "extra", "name": "one"}), same),
        ("the channel again", rows_steps, lambda: ("add_channel", {"topic": "extra", "name": "one"}), same),
        ("a channel of no topic", rows_steps, lambda: ("add_channel", {"topic": "nowhere", "name": "one"}), same),
        ("place it", rows_steps, lambda: ("place_topic", {"name": "extra", "cluster": "main", "draining": ["old"]}), same),
        ("place no topic", rows_steps, lambda: ("place_topic", {"name": "nowhere", "cluster": "main", "draining": []}), same),
        ("its settings", update_topic_settings_steps, lambda: ("extra", lambda before: dict(before, rate_limit=7)), same),
        ("its retention back to the server's", update_topic_settings_steps,
         lambda: ("extra", lambda before: dict(before, retention_ms=None)), same),
        ("it is no longer ordered", update_topic_settings_steps,
         lambda: ("extra", lambda before: dict(before, ordered=False)), same),
        ("it is ordered again", update_topic_settings_steps,
         lambda: ("extra", lambda before: dict(before, ordered=True)), same),
        ("no topic's settings", update_topic_settings_steps, lambda: ("nowhere", lambda before: before), same),
        ("the mirror adds a channel and an ordered topic, changes settings (extra is not ordered)",
         mirror_topics_steps, lambda: (_specs(extra, TopicSpec("mirrored", channels=("c1",), ordered=True)),), same),
        ("the mirror again: nothing changes", mirror_topics_steps,
         lambda: (_specs(extra, TopicSpec("mirrored", channels=("c1",), ordered=True)),), same),
        ("the mirror orders a topic", mirror_topics_steps,
         lambda: (_specs(dataclasses.replace(extra, ordered=True, version=(ZK_EPOCH, 12)),
                         TopicSpec("mirrored", channels=("c1",))),), same),
        ("the mirrored settings", list_topics_steps, lambda: (), same),
        ("a stale view: the newer row stays (a move's fence)", mirror_topics_steps,
         lambda: (_specs(dataclasses.replace(extra, cluster="old", version=(ZK_EPOCH, 11)),
                         TopicSpec("mirrored", channels=("c1",))),), same),
        ("the settings stayed", list_topics_steps, lambda: (), same),
        ("the mirror drops a topic and a channel", mirror_topics_steps,
         lambda: (_specs(dataclasses.replace(extra, channels=("two",), version=(ZK_EPOCH, 13))),), same),
        ("topics", list_topics_steps, lambda: (), same),
        ("remove a channel", rows_steps, lambda: ("remove_channel", {"topic": "extra", "name": "two"}), same),
        ("remove it again", rows_steps, lambda: ("remove_channel", {"topic": "extra", "name": "two"}), same),
        ("delete a topic", rows_steps, lambda: ("delete_topic", {"name": "extra"}), same),
        ("delete it again", rows_steps, lambda: ("delete_topic", {"name": "extra"}), same),
        # incarnations
        ("an incarnation", create_owner_steps, lambda: (NODE,), same),
        ("it beats", owner_heartbeat_steps, lambda: (OWNER,), same),
        ("no such incarnation beats", owner_heartbeat_steps, lambda: (99,), same),
        ("no such backend", backends_alive_steps, lambda: ([2**31 - 1],), same),
        # messages, an ack, returns: what the trace and the stats read (m2 with properties:
        # its trace and the peeks show them)
        ("a batch", insert_messages_steps,
         lambda: ([_msg("p", 1), _msg("p", 2, props=PROPS), _msg("p", 3), _msg("s", 1, topic="short")], NODE, OWNER),
         same),
        ("an ack", ack_deliveries_steps, lambda: ([AckRow("orders", "billing", m["m1"], 1_700_000_000_000,
                                                         1_700_000_001_000, 2, "nsq c@h:1", 1_700_000_000_500, OWNER)],
                                                 cursor("billing", 0, (m["m1"], m["m1"])), NODE), same),
        ("returns", record_returns_steps,
         lambda: ([ReturnRow(m["m1"], "orders", "billing", 1, "timeout", "nsq c@h:1", LONG_AGO, LONG_AGO + 500)], NODE), same),
        ("the trace of an acknowledged message", read_trace_steps, lambda: (m["m1"], 2), same),
        ("the trace of a waiting message", read_trace_steps, lambda: (m["m2"],), same),
        ("the trace of nothing", read_trace_steps, lambda: (999_999_999,), same),
        ("find by session", find_message_steps, lambda: ("p", 2), lambda i: k.m(i)),
        ("find nothing", find_message_steps, lambda: ("p", 99), same),
        ("peek", peek_channel_steps, lambda: ("orders", "billing", 0, 10, 1), same),
        ("peek after a message, limited", peek_channel_steps, lambda: ("orders", "audit", m["m1"], 1), same),
        ("gauges", read_gauges_steps, lambda: ({("orders", "billing"): m["m2"], ("orders", "audit"): None,
                                                ("quiet", "x"): 999_999_999},), same),
        ("stats", stored_stats_steps, lambda: (), same),
        ("sweep old returns", sweep_trace_steps, lambda: (60, 100), same),
        # the expiry of a topic with a time to live
        ("open the cursors to expire", open_ttl_cursors_steps, lambda: (), same),
        ("expire", expire_deliveries_steps, lambda: (int(time.time() * 1000) + 60_000, 10),
         lambda rows: [(t, c, k.m(i)) for t, c, i in rows]),
        ("expire again", expire_deliveries_steps, lambda: (int(time.time() * 1000) + 60_000, 10), same),
        # dead letters
        # with a message's properties (key, priority, headers), none, and a key alone
        ("dead letters", insert_dead_letters_steps, lambda: ([
            NewDeadLetter("rate_limited", "orders", "p", 7, b"seven", published_ms=1_700_000_000_000,
                          properties=LETTER_PROPERTIES),
            NewDeadLetter("client_reported", "orders", "p", 8, b"eight", channel="billing", detail="lost"),
            NewDeadLetter("operator", "quiet", "q", 1, b"\xff", properties=Properties("q-1")),
        ],), lambda new: [k.d(i) for i in new]),
        ("list", list_dead_letters_steps, lambda: (EVERY, 10, 0), letters),
        ("list after one, limited", list_dead_letters_steps, lambda: (EVERY, 1, d["d2"]), letters),
        ("list by reason and topic", list_dead_letters_steps,
         lambda: (dict(EVERY, reason="expired", topic="short"), 10, 0), letters),
        ("list by ids and message ids", list_dead_letters_steps,
         lambda: (dict(EVERY, ids=[d["d1"], d["d4"]], message_ids=[m["m4"]]), 10, 0), letters),
        ("list by time", list_dead_letters_steps,
         lambda: (dict(EVERY, since_ms=int(time.time() * 1000) - 60_000, until_ms=int(time.time() * 1000) + 60_000), 10, 0),
         lambda rows: len(rows)),
        ("count", count_dead_letters_steps, lambda: (EVERY,), same),
        ("show", show_dead_letter_steps, lambda: (d["d4"],), letters),
        ("show nothing", show_dead_letter_steps, lambda: (999_999_999,), same),
        ("show one with properties", show_dead_letter_steps, lambda: (d["d1"],), letters),
        ("replay orders'", replay_batch_steps, lambda: (dict(EVERY, topic="orders"), 0, 10, 1, 1_700_000_000_000, "n1"),
         lambda out: (k.d(out[0]), out[1])),
        ("replay them again", replay_batch_steps, lambda: (dict(EVERY, topic="orders"), 0, 10, 1, 1_700_000_000_000, "n1"), same),
        ("not replayed", count_dead_letters_steps, lambda: (dict(EVERY, replayed=False),), same),
        ("by reason", dead_letter_counts_steps, lambda: (), same),
        ("delete a batch", delete_batch_steps, lambda: (dict(EVERY, topic="quiet"), 0, 10), lambda out: (k.d(out[0]), out[1])),
        ("delete none", delete_batch_steps, lambda: (dict(EVERY, topic="quiet"), 0, 10), same),
        ("audit", log_operation_steps, lambda: ("cli", "me", "dlq.delete", "topic=quiet", 1), same),
        ("audit again", log_operation_steps, lambda: ("http", "you", "dlq.replay", "all", 2), same),
        ("the audit log", list_admin_log_steps, lambda: (2**62, 10), lambda rows: [k(dict(r, id=None)) for r in rows]),
        ("the audit log, limited", list_admin_log_steps, lambda: (2**62, 1), lambda rows: [r["operation"] for r in rows]),
        # delayed sends
        ("delays", insert_delayed_steps, lambda: ([
            NewDelayed(NewMessage("orders", "dp", 1, 0, b"due"), LONG_AGO, 1),
            NewDelayed(NewMessage("orders", "dp", 2, 1_700_000_000_000, b"later"), LATER, 2),
            NewDelayed(NewMessage("quiet", "dp", 3, 0, b"orphan"), LONG_AGO, 3),
            NewDelayed(NewMessage("orders", "dp", 4, 0, b"overflow"), LATER + 1, 9),
            NewDelayed(NewMessage("orders", "dp", 5, 0, b"with properties", PROPS), LONG_AGO, 1),
        ], NODE), lambda out: [k(dataclasses.replace(s, message_id=k.y(s.message_id))) for s in out]),
        ("a resent delay and a stored pair", insert_delayed_steps, lambda: ([
            NewDelayed(NewMessage("orders", "dp", 1, 0, b"due"), LONG_AGO, 1),
            NewDelayed(NewMessage("orders", "p", 1, 0, b"x"), LONG_AGO, 1),
        ], NODE), lambda out: [(s.duplicate, s.kind, s.due_ms) for s in out]),
        ("a delayed outbox row", insert_delayed_steps, lambda: ([
            NewDelayed(NewMessage("orders", OUTBOX + ":delayed", 1, 0, b"ob"), LATER + 2, 1),
        ], NODE), lambda out: [(s.duplicate, s.kind, s.due_ms) for s in out]),
        ("its repeat beside a new one", insert_delayed_steps, lambda: ([
            NewDelayed(NewMessage("orders", OUTBOX + ":delayed", 1, 0, b"ob"), LATER + 2, 1),
            NewDelayed(NewMessage("orders", OUTBOX + ":delayed", 2, 0, b"ob2"), LATER + 2, 1),
        ], NODE), lambda out: [(s.duplicate, s.kind, s.due_ms) for s in out]),
        ("a delayed outbox row with properties", insert_delayed_steps, lambda: ([
            NewDelayed(NewMessage("orders", OUTBOX + ":delayed", 3, 0, b"ob3", PROPS), LATER + 2, 1),
        ], NODE), lambda out: [(s.duplicate, s.kind, s.due_ms) for s in out]),
        # (a replay's fragment follows its dead letter's id, which differs: one fragment, 1)
        ("peek", peek_delayed_steps, lambda: ((1, 2, 3, 4), 8, LATER, 10), same),
        ("peek with the fragments above", peek_delayed_steps, lambda: ((8,), 8, LATER + 1, 10), same),
        ("peek a few", peek_delayed_steps, lambda: ((1, 2, 3, 4), 8, LATER, 2), same),
        ("delay stats", delay_stats_steps, lambda: (), same),
        ("the delays browsed", list_delayed_steps, lambda: (None, 0, 0, 10, 3), same),
        ("a topic's, after one", list_delayed_steps, lambda: ("orders", LONG_AGO, 2**62, 10), same),
        ("by due time", due_histogram_steps, lambda: (None, LATER - 10, 100), same),
        ("a topic's by due time", due_histogram_steps, lambda: ("quiet", 0, 1000), same),
        ("the trace of a delay", read_trace_steps, lambda: (y["y2"],), same),
        ("the trace of a delay with properties", read_trace_steps, lambda: (y["y5"],), same),
        ("deliver now", deliver_delayed_now_steps, lambda: ([y["y2"], y["y1"], 999_999_999], LATER - 5), lambda ids: [k.y(i) for i in ids]),
        ("cancel", cancel_delayed_steps, lambda: ([y["y4"], 999_999_999],), lambda ids: [k.y(i) for i in ids]),
        ("move what is due", move_due_steps, lambda: ((1, 2, 3, 4), 4, LATER, 10, NODE, OWNER), moved_view),
        ("nothing more is due", move_due_steps, lambda: ((1, 2, 3, 4), 4, LATER, 10, NODE, OWNER), moved_view),
        ("the trace of a replay", read_trace_steps, lambda: (k.m.real["m7"],), same),
        ("dead letters now", list_dead_letters_steps, lambda: (EVERY, 10, 0), letters),
        # takeover
        ("another node's incarnation", create_owner_steps, lambda: ("node-2",), same),
        ("it stores", insert_messages_steps, lambda: ([_msg("n2", 1)], "node-2", OWNER + 1), same),
        # an ordered topic whose copies node-1 and node-2 stored; node-3 is its orderer
        ("an ordered topic", rows_steps, lambda: ("create_topic", {"name": "ledger", "store": "reliable",
         "msg_timeout_ms": 1000, "rate_limit": None, "ttl_ms": None, "max_attempts": None, "cluster": "main",
         "ordered": True, "retention_ms": None}), same),
        ("its channel", rows_steps, lambda: ("add_channel", {"topic": "ledger", "name": "c"}), same),
        ("node-2 stores on it", insert_messages_steps,
         lambda: ([_msg("l2", n, topic="ledger") for n in (1, 2, 3, 4)], "node-2", OWNER + 1), same),
        ("node-1 stores on it", insert_messages_steps,
         lambda: ([_msg("l1", n, topic="ledger") for n in (1, 2)], NODE, OWNER), same),
        ("node-2 acks a copy of its own (its cursor opens)", ack_pair_steps,
         lambda: ("l2", 1, "ledger", OWNER + 1, "node-2"), same),
        ("the orderer claims the topic's cursors", claim_ordered_cursors_steps, lambda: ("ledger", "node-3"), same),
        ("its claim again", claim_ordered_cursors_steps, lambda: ("ledger", "node-3"), same),
        ("node-2's ack after the claim is fenced", ack_pair_steps, lambda: ("l2", 2, "ledger", OWNER + 1, "node-2"), same),
        ("the orderer's ack moves the cursor", ack_pair_steps, lambda: ("l2", 2, "ledger", OWNER + 1, "node-3"), same),
        ("node-1's ack of its own copy is fenced too", ack_pair_steps, lambda: ("l1", 1, "ledger", OWNER, NODE), same),
        # a channel registered since the claim, with a copy of node-2's: no cursor yet
        ("a second channel", rows_steps, lambda: ("add_channel", {"topic": "ledger", "name": "c2"}), same),
        ("node-2 stores on both", insert_messages_steps, lambda: ([_msg("l2", 5, topic="ledger")], "node-2", OWNER + 1),
         same),
        ("candidates", takeover_candidates_steps, lambda: (), same),
        ("copies by holder", owner_depths_steps, lambda: (), same),
        ("claim node-2's", claim_owners_steps, lambda: ("node-2", [OWNER + 1], NODE, [NODE]), same),
        ("claim again", claim_owners_steps, lambda: ("node-2", [OWNER + 1], NODE, [NODE]), same),
        ("the takeover left the orderer its cursor of node-2's", ack_pair_steps,
         lambda: ("l2", 3, "ledger", OWNER + 1, "node-3"), same),
        ("the taker's ack of it is fenced", ack_pair_steps, lambda: ("l2", 3, "ledger", OWNER + 1, NODE), same),
        ("candidates after", takeover_candidates_steps, lambda: (), same),
        ("copies by holder after", owner_depths_steps, lambda: (), same),
        # the topic is no longer ordered: node-1's live incarnation gets its cursor back,
        # node-2's retired one stays with the orderer
        ("the orderer releases the topic", release_ordered_cursors_steps, lambda: ("ledger", "node-3"), same),
        ("its release again", release_ordered_cursors_steps, lambda: ("ledger", "node-3"), same),
        ("node-1 acks its own copy again", ack_pair_steps, lambda: ("l1", 1, "ledger", OWNER, NODE), same),
        ("the orderer's ack of it is fenced", ack_pair_steps, lambda: ("l1", 2, "ledger", OWNER, "node-3"), same),
        ("the orderer keeps the retired incarnation's", ack_pair_steps,
         lambda: ("l2", 4, "ledger", OWNER + 1, "node-3"), same),
        ("copies by holder released", owner_depths_steps, lambda: (), same),
        ("a retired incarnation moves nothing", move_due_steps, lambda: ((1,), 1, LATER, 10, "node-2", OWNER + 1),
         lambda e: type(e).__name__),
        ("what a topic leaves", topic_leftovers_steps, lambda: ("orders",), same),
        ("what no topic leaves", topic_leftovers_steps, lambda: ("nowhere", datetime.now().astimezone()), same),
        # several clusters: last, since a database claimed for "eu" stores none of main's topics
        ("slots", assign_slots_steps, lambda: (["main", "eu"],), same),
        ("slots again", assign_slots_steps, lambda: (["eu", "us"],), same),
        ("claim the database", claim_cluster_steps, lambda: ("eu", 1), same),
        ("claim it again", claim_cluster_steps, lambda: ("eu", 1), same),
        ("claimed by another", claim_cluster_steps, lambda: ("main", 0), lambda e: str(e)),
        ("ids in the slot", insert_messages_steps, lambda: ([_msg("e", 1, topic="orders")], NODE, OWNER),
         lambda out: [type(x).__name__ for x in out]),
    ]


def run_script(run: Callable[..., Any], make: Callable[..., list] = script, k: Any = None) -> list[tuple[str, Any]]:
    ids = k if k is not None else Ids()
    answers = []
    for label, steps_fn, args, view in make(ids):
        try:
            answer = run(steps_fn, *args())
        except (StorageError, Fenced, ClusterMismatch) as exc:  # an answer too: which error
            answer = exc
        answers.append((label, view(answer)))
    return answers


def _arrange_pg(dsn: str) -> None:
    migrate(dsn)
    with connect(dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders", msg_timeout_ms=60000)
        registry.add_channel(conn, "orders", "billing")
        registry.add_channel(conn, "orders", "audit")
        registry.create_topic(conn, "quiet", msg_timeout_ms=30000, rate_limit=5)
        registry.create_topic(conn, "short", ttl_ms=1)
        registry.add_channel(conn, "short", "c")


def _arrange_memory() -> MemoryDb:
    db = MemoryDb()
    db.create_topic("orders", ["billing", "audit"], msg_timeout_ms=60000)
    db.create_topic("quiet", msg_timeout_ms=30000, rate_limit=5)
    db.create_topic("short", ["c"], ttl_ms=1)
    return db


def _memory_runner(db: MemoryDb) -> Callable[..., Any]:
    def run(steps_fn: Callable[..., Steps], *args: Any) -> Any:
        out: list[Any] = []
        db.run_steps(steps_fn, *args).addBoth(out.append)
        if hasattr(out[0], "raiseException"):
            out[0].raiseException()
        return out[0]

    return run


def _compare(expected: list[tuple[str, Any]], actual: list[tuple[str, Any]]) -> None:
    for (label, want), (_, got) in zip(expected, actual):
        assert got == want, f"{label}: PostgreSQL answered {want!r}, the double {got!r}"
    assert len(actual) == len(expected)


def test_the_double_answers_the_script_as_postgresql_does(pg_dsn):
    _arrange_pg(pg_dsn)
    with connect(pg_dsn, autocommit=True) as conn:
        expected = run_script(lambda steps_fn, *args: run_steps(conn, steps_fn(*args)))
    _compare(expected, run_script(_memory_runner(_arrange_memory())))


def _pg_runner(conn: psycopg.Connection) -> Callable[..., Any]:
    """Each run in a transaction of its own, as a ``DbWorker`` runs it."""
    def run(steps_fn: Callable[..., Steps], *args: Any) -> Any:
        with conn.transaction():
            return run_steps(conn, steps_fn(*args))

    return run


def test_the_double_answers_the_operators_script_as_postgresql_does(pg_dsn):
    """Admin operations, trace, delays, expiry, takeover, the registry's mirror, clusters."""
    _arrange_pg(pg_dsn)
    with connect(pg_dsn, autocommit=True) as conn:
        expected = run_script(_pg_runner(conn), operators_script, Kinds())
    _compare(expected, run_script(_memory_runner(_arrange_memory()), operators_script, Kinds()))


def _names_run(make: Callable[..., list], k: Any) -> set[str]:
    db = _arrange_memory()
    run_script(_memory_runner(db), make, k)
    return set(db.names_run())


def test_every_statement_has_a_handler_and_a_case():
    """Every statement the server may run (all of sql/queries.sql and the variants the
    db modules derive, but the migrator's) has a handler in the double, and one of the
    scripts above runs it (so the comparisons check it against PostgreSQL)."""
    handled = set(MemoryDb()._handlers)
    server = set(STATEMENTS) - set(MIGRATOR_STATEMENTS)
    assert not sorted(server - handled), f"statements without a handler in db/memory.py: {sorted(server - handled)}"
    checked = _names_run(script, Ids()) | _names_run(operators_script, Kinds())
    assert not sorted(server - checked), f"statements no contract case runs: {sorted(server - checked)}"
    assert set(MIGRATOR_STATEMENTS) <= set(STATEMENTS)


def test_the_script_is_not_trivial(pg_dsn):
    """The answers hold what the script is about (so equal answers mean something)."""
    _arrange_pg(pg_dsn)
    with connect(pg_dsn, autocommit=True) as conn:
        answers = dict(run_script(lambda steps_fn, *args: run_steps(conn, steps_fn(*args))))
    assert answers["a stored pair fails the fast insert"] == "unique violation"
    assert answers["a repeat fails the fast ack"] == "division by zero"
    resend = answers["a batch with a resend, a new pair twice, a topic without channels"]
    assert [s["duplicate"] for s in resend] == [True, False, True, False]
    assert resend[3]["channels"] == ()
    # ids follow (producer, session_id) order in a batch, in both: a9 (m3) got the first id
    # p1 (m1) and p3 (m4) acknowledged out of order: spans above the floor
    assert [r["message_id"] for r in answers["backlog"]] == ["m3", "m2"]  # m2: its fenced ack changed nothing
    assert answers["in a cluster, another node's ack of a cursor it does not hold is fenced"] == [("orders", "billing", OWNER)]
    assert answers["ack of a copy already done"] == []  # the node holding the cursor: applied
    assert answers["exhaust"] == [("orders", "billing", "m2")]
    # acked (m1, m4) and dead-lettered (m2, exhausted) on billing, waiting on audit; a message no
    # longer stored was done on every channel
    assert answers["consumed states"] == [
        ("m1", "audit", "waiting"), ("m1", "billing", "acked"), ("m2", "audit", "waiting"), ("m2", "billing", "dead"),
        ("m4", "audit", "waiting"), ("m4", "billing", "acked"), ("gone", "audit", "acked"), ("gone", "billing", "acked"),
    ]
    assert answers["in a cluster, another node's exhaust of a cursor it does not hold is fenced"] == []
    assert answers["pause"] == 1 and answers["pause again"] == 0
    assert answers["empty a channel"] > 0
    assert answers["depths at the end"] == (None, {("orders", "billing"): 1}, {("orders", "billing"): "m3"})  # a9; p1, p3 acked, p2 exhausted
    # a slice of one message leaves the pass open; one of 1000 ends it
    whole = answers["depths, a pass of one slice"]
    assert whole[0] is None and sum(whole[1].values()) > 1
    first, rest = answers["depths, a first slice of one message"], answers["depths, the slices above a message"]
    assert first[0] is False and sum(first[1].values()) >= 1 and rest[0] is True
    assert answers["a retired incarnation stores nothing"] == "Fenced"
    assert answers["sweep what no channel holds"] > 0
    assert [s["duplicate"] for s in answers["outbox rows among others"]] == [False, False, False]
    assert answers["a recorded outbox row fails the fast insert"] == "unique violation"
    assert [s["duplicate"] for s in answers["a repeat of a recorded outbox row is a resend"]] == [True, False]
    assert answers["a swept outbox row's repeat fails the fast insert (its record)"] == "unique violation"
    assert answers["a repeat of a swept outbox row is not stored"] == ["Misplaced", "StoredMessage"]
    assert answers["nothing of the repeat stored"] == [("r", 2)]


def test_dead_letters_keep_their_properties(pg_dsn):
    """A dead letter recorded with its message's key, priority and headers is listed and
    shown with them, and one recorded without has none (NULL, 0, NULL); the double's
    answers equal these (test_the_double_answers_the_operators_script_as_postgresql_does)."""
    _arrange_pg(pg_dsn)
    with connect(pg_dsn, autocommit=True) as conn:
        answers = dict(run_script(_pg_runner(conn), operators_script, Kinds()))
    by_session = {(r["producer"], r["session_id"]): r for r in answers["list"]}
    props = LETTER_PROPERTIES
    assert [(r["key"], r["priority"], r["headers"]) for r in (by_session["p", 7], by_session["p", 8], by_session["q", 1])] == [
        (props.key, props.priority, dict(props.headers)), (None, 0, None), ("q-1", 0, None)]
    shown = answers["show one with properties"]
    assert (shown["session_id"], shown["key"], shown["priority"], shown["headers"], shown["body"]) == (
        7, props.key, props.priority, dict(props.headers), "seven")
    # jsonb's order of names (shorter first), which the double keeps too (dicts compare equal
    # in any order, so the comparison above cannot see it): a replay's status is the same text
    assert list(shown["headers"]) == ["x.trace", "content-type"]
    double = dict(run_script(_memory_runner(_arrange_memory()), operators_script, Kinds()))
    assert list(double["show one with properties"]["headers"]) == ["x.trace", "content-type"]


def test_exhausted_and_expired_copies_keep_their_properties(pg_dsn):
    """The script's copy with properties past its attempts and its message past its time to
    live are dead letters with the message's key, priority and headers (jsonb's order of
    names: shortest first), as the double's are (the comparison above)."""
    _arrange_pg(pg_dsn)
    with connect(pg_dsn, autocommit=True) as conn:
        answers = dict(run_script(lambda steps_fn, *args: run_steps(conn, steps_fn(*args))))
    assert len(answers["a copy with properties exhausted"]) == 1 and len(answers["it expires"]) == 1
    assert answers["a node holding none of its cursors expires nothing"] == []
    kept = [r for r in answers["the dead letters with their properties"] if r[1] in ("k", "t")]
    assert [(r[0], r[1], r[4], r[5], r[6], r[7]) for r in kept] == [
        (reason, producer, PROPS.key, PROPS.priority, dict(PROPS.headers), ["tenant", "content-type"])
        for reason, producer in (("max_attempts", "k"), ("expired", "t"))]


def test_an_orderer_claims_and_releases_an_ordered_topics_cursors(pg_dsn):
    """The operators script's ordered topic (issue 45, across nodes), as PostgreSQL answers
    it (the double's answers equal these): the orderer's claim opens node-1's cursor and
    moves node-2's, after which their fenced acks move nothing; a takeover of node-2
    retires its incarnation but leaves the ordered channel's cursor with the orderer (and
    names no holder of ordered cursors as a candidate); the release gives node-1's live
    incarnation its cursor back and keeps node-2's retired one."""
    _arrange_pg(pg_dsn)
    with connect(pg_dsn, autocommit=True) as conn:
        answers = dict(run_script(_pg_runner(conn), operators_script, Kinds()))
    ledger_1, ledger_2 = ("ledger", "c", OWNER), ("ledger", "c", OWNER + 1)
    assert answers["node-2 acks a copy of its own (its cursor opens)"] == []
    assert (answers["the orderer claims the topic's cursors"], answers["its claim again"]) == (
        {"count": 2, "taken_from": frozenset({"node-2"})}, {"count": 0, "taken_from": frozenset()})
    assert answers["node-2's ack after the claim is fenced"] == [ledger_2]
    assert answers["the orderer's ack moves the cursor"] == []
    assert answers["node-1's ack of its own copy is fenced too"] == [ledger_1]
    assert "node-3" not in answers["candidates"]
    claimed = answers["claim node-2's"]
    assert claimed and all(topic != "ledger" for topic, _, _ in claimed)  # neither c's cursor nor one on c2
    assert answers["a retired incarnation moves nothing"] == "Fenced"  # claim_owners retired it
    assert answers["candidates after"].get("node-2") is None
    assert answers["the takeover left the orderer its cursor of node-2's"] == []
    assert answers["the taker's ack of it is fenced"] == [ledger_2]
    assert (answers["the orderer releases the topic"], answers["its release again"]) == (1, 0)
    assert answers["node-1 acks its own copy again"] == []
    assert answers["the orderer's ack of it is fenced"] == [ledger_1]
    assert answers["the orderer keeps the retired incarnation's"] == []


def _skewed_seeks(run: Callable[..., Any], set_rows: Callable[[dict[int, int], list[int]], None],
                  start: int) -> list[tuple[str, Any]]:
    """Issue 46: two incarnations store 80 messages of orders, published a second apart an
    hour ago less up to 29.999 s each (ids and times disagree by less than the skew), all
    acknowledged on billing; then seeks of billing to times drawn at random (a fixed seed),
    the edges, ids and the latest, each followed by what billing waits for and by whom."""
    ids = Ids()
    owners = [run(create_owner_steps, node) for node in ("node-1", "node-2")]
    stored: dict[int, int] = {}
    for n in range(80):
        owner = owners[n % 2]
        (s,) = run(insert_messages_steps, [_msg("skew", n)], f"node-{owner}", owner)
        stored[s.message_id] = owner
    rng = random.Random(46)
    times = {mid: start + i * 1000 - rng.randint(0, 29_999) for i, mid in enumerate(sorted(stored))}
    set_rows(times, sorted(stored)[30:50:4])  # and five made audit's alone (replays for one channel)
    for owner in owners:
        mine = sorted(mid for mid, o in stored.items() if o == owner)
        run(ack_deliveries_steps, [AckRow("orders", "billing", mid, 1, 2, 1, owner=owner) for mid in mine],
            [CursorProgress("orders", "billing", owner, mine[-1], [])], f"node-{owner + 6}")  # (taken over)
    ordered = sorted(stored)
    targets: list[tuple[SeekTarget, bool]] = [(ToTime(start - 60_000), False), (ToTime(start + 90_000), False),
                                              (ToLatest(), True), (ToId(ordered[17]), False), (ToLatest(), False)]
    targets += [(ToTime(rng.randint(start, start + 80_000)), rng.random() < 0.3) for _ in range(8)]
    targets += [(ToTime(times[rng.choice(ordered)]), False) for _ in range(4)]
    answers: list[tuple[str, Any]] = []
    for target, dry_run in targets:
        label = f"seek to {type(target).__name__}{' (dry run)' if dry_run else ''}"
        answers.append((label, sought_view(run(seek_or_refusal_steps, "orders", "billing", target, dry_run), ids)))
        if isinstance(target, ToTime):
            bounds = run(seek_bounds_steps, target.ms)
            answers.append(("its bounds", (ids(bounds.lo), ids(bounds.hi))))
        waiting = run(peek_channel_steps, "orders", "billing", 0, 1000)
        answers.append(("billing waits for", [(ids(r["message_id"]), r["owner"], r["published_ms"]) for r in waiting]))
        answers.append(("by holder", run(owner_depths_steps)))
    # a channel registered now, sought to the first id: each incarnation's new cursor is held
    # where its cursor of billing is (node-7, node-8), else where any of its cursors is (a
    # third's of another topic, by node-9), else by its node (a fourth's, node-4)
    third, fourth = (run(create_owner_steps, node) for node in ("node-3", "node-4"))
    for owner in (third, fourth):
        run(insert_messages_steps, [_msg(f"late{owner}", 1)], f"node-{owner}", owner)
    run(open_cursor_steps, "short", "c", third, "node-9")
    # the first's cursor of a topic first in name order, by node-5: its cursor of billing names the holder
    run(rows_steps, "create_topic", {"name": "aaa", "store": "reliable", "msg_timeout_ms": 1000, "rate_limit": None,
                                     "ttl_ms": None, "max_attempts": None, "cluster": "main", "ordered": False,
                                     "retention_ms": None})
    run(rows_steps, "add_channel", {"topic": "aaa", "name": "x"})
    run(open_cursor_steps, "aaa", "x", owners[0], "node-5")
    run(rows_steps, "add_channel", {"topic": "orders", "name": "fresh"})
    answers.append(("a channel registered now, sought back", sought_view(
        run(seek_or_refusal_steps, "orders", "fresh", ToId(1)), ids)))
    answers.append(("its copies by holder", run(owner_depths_steps)))
    return answers


def open_cursor_steps(topic: str, channel: str, owner: int, holder: str) -> Steps:
    """A cursor of ``owner`` held by ``holder``, opened by an ack statement with no acks (the
    statement as written: the fast one refuses a batch without acks)."""
    fast = next(ack_deliveries_steps([], [CursorProgress(topic, channel, owner, 0, [])], holder))
    return [tuple(row) for row in (yield Statement("ack_deliveries", fast.params))]


def test_the_double_seeks_as_postgresql_does_with_skewed_publish_times(pg_dsn):
    """The seek's statements on both databases, over publish times that disagree with the
    ids by up to the skew (each set on both: PostgreSQL's by an UPDATE, the double's
    message rows): the same counts, bounds, copies waiting and holders."""
    start = int(time.time() * 1000) - 3_600_000  # the first message's time, in both
    _arrange_pg(pg_dsn)
    with connect(pg_dsn, autocommit=True) as conn:
        def set_pg(times: dict[int, int], audit_only: list[int]) -> None:
            conn.execute("UPDATE dmq_message m SET published_at = timestamptz 'epoch' + u.ms * interval '1 millisecond' "
                         "FROM unnest(%s::bigint[], %s::bigint[]) AS u(id, ms) WHERE m.id = u.id",
                         (list(times), list(times.values())))
            conn.execute("UPDATE dmq_message SET channel = 'audit' WHERE id = ANY(%s)", (audit_only,))

        expected = _skewed_seeks(_pg_runner(conn), set_pg, start)
    db = _arrange_memory()

    def set_memory(times: dict[int, int], audit_only: list[int]) -> None:
        for mid, ms in times.items():
            db.messages[mid].published_ms = ms
        for mid in audit_only:
            db.messages[mid].channel = "audit"

    actual = _skewed_seeks(_memory_runner(db), set_memory, start)
    _compare(expected, actual)
    # not trivial: seeks to times in the middle leave some waiting and not all
    counts = [a[1] for label, a in expected if label == "seek to ToTime"]
    assert any(0 < c < 75 for c in counts) and 75 in counts


LIMIT = 3  # an expiry pass's


def _skewed_expiry(run: Callable[..., Any], set_times: Callable[[dict[int, int]], None],
                   start: int) -> tuple[list[tuple[str, Any]], dict[str, int], list[tuple[int, list[str]]]]:
    """Two incarnations store 40 messages of ``short`` (a time to live of 1 ms), published
    half a second apart less up to 2.999 s each (a later id older than an earlier one, as a
    long transaction's would be), then expiry passes of 3 at times through them and past them.
    The answers, each message's time by alias, and each pass's (now, expired aliases)."""
    ids = Ids()
    owners = [run(create_owner_steps, node) for node in ("node-1", "node-2")]
    stored = [run(insert_messages_steps, [_msg("ttl", n, topic="short")], f"node-{owners[n % 2]}", owners[n % 2])[0]
              for n in range(40)]
    for s in stored:  # m1..m40 in id order
        ids(s.message_id)
    rng = random.Random(48)
    times = {s.message_id: start + i * 500 - rng.randint(0, 2_999) for i, s in enumerate(stored)}
    times[stored[23].message_id] = times[stored[17].message_id] - 1_500  # m24 older than node-2's m18, m20, m22
    set_times(times)
    answers: list[tuple[str, Any]] = []
    passes: list[tuple[int, list[str]]] = []
    for now in [*range(start + 1_000, start + 21_000, 700), *[start + 60_000] * 8]:
        answers.append(("cursors opened", run(open_ttl_cursors_steps)))  # as the sweep: committed first
        rows = run(expire_deliveries_steps, now, LIMIT)
        passes.append((now, [ids(i) for _, _, i in rows]))
        answers.append((f"expire at start + {now - start} ms", [(t, c, ids(i)) for t, c, i in rows]))
        waiting = run(peek_channel_steps, "short", "c", 0, 1000)
        answers.append(("short waits for", [ids(r["message_id"]) for r in waiting]))
    return answers, {ids(i): ms for i, ms in times.items()}, passes


def test_the_double_expires_as_postgresql_does_with_skewed_publish_times(pg_dsn):
    """The expiry (issue 48: a pass reads each cursor's first copies in id order, and tests
    the time to live on those) over publish times that disagree with the ids: the same
    batches on both databases; no copy expires before its time; a copy past its time
    behind a younger one waits for it, and goes with it; in the end every copy is a dead
    letter, once."""
    start = int(time.time() * 1000) - 3_600_000
    _arrange_pg(pg_dsn)
    with connect(pg_dsn, autocommit=True) as conn:
        def set_pg(times: dict[int, int]) -> None:
            conn.execute("UPDATE dmq_message m SET published_at = timestamptz 'epoch' + u.ms * interval '1 millisecond' "
                         "FROM unnest(%s::bigint[], %s::bigint[]) AS u(id, ms) WHERE m.id = u.id",
                         (list(times), list(times.values())))

        expected, times, passes = _skewed_expiry(_pg_runner(conn), set_pg, start)
    db = _arrange_memory()

    def set_memory(times: dict[int, int]) -> None:
        for mid, ms in times.items():
            db.messages[mid].published_ms = ms

    actual, _, _ = _skewed_expiry(_memory_runner(db), set_memory, start)
    _compare(expected, actual)
    expired = [alias for _, batch in passes for alias in batch]
    assert sorted(expired) == sorted(times) and len(set(expired)) == 40  # every copy once
    held = 0
    done: set[str] = set()
    for now, batch in passes:
        assert all(times[alias] < now - 1 for alias in batch)  # none before its time
        before, done = done, done | set(batch)
        if len(batch) == LIMIT:
            continue
        # what is past its time and still waits after a pass that was not full: a pass
        # reads each incarnation's first LIMIT copies, so as many of its incarnation's
        # copies were before it, a younger one among them (aliases number the ids in
        # order; the incarnations alternate)
        for alias in sorted(set(times) - done):
            if times[alias] < now - 1:
                number = int(alias[1:])
                ahead = [f"m{k}" for k in range(number % 2 or 2, number, 2) if f"m{k}" not in before]
                assert len(ahead) >= LIMIT and any(times[a] >= now - 1 for a in ahead), (now, alias, ahead)
                held += 1
    assert held, passes  # not trivial: some pass held a copy back

"""The in-memory double answers as PostgreSQL does: one script, two databases.

The same steps (the server's own: ``db.messages``, ``db.dead_letters``, ``db.topics``)
run in the same order on ``MemoryDb`` and on a migrated PostgreSQL (autocommit, as the
writers run them), and every answer must be equal once the values that differ by
nature are made comparable: message ids become their order of first appearance and
timestamps only have to be "now". If a statement of ``sql/queries.sql`` changes what
it answers, this test fails until ``dmq_server/db/memory.py`` follows, so the unit
tests built on the double (broker, protocol) cannot drift from the SQL silently.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import psycopg

import registry
from dmq_server.db.dead_letters import (
    CopyRef,
    NewDeadLetter,
    exhaust_deliveries_steps,
    insert_dead_letters_steps,
    record_attempts_steps,
)
from dmq_server.db.errors import StorageError
from dmq_server.db.memory import MemoryDb
from dmq_server.db.messages import (
    AckRow,
    CursorProgress,
    NewMessage,
    ack_deliveries_steps,
    create_owner_steps,
    empty_channel_steps,
    insert_messages_steps,
    read_owners_steps,
    retire_silent_owners_steps,
    load_backlog_steps,
    read_channel_state_steps,
    depth_slice_steps,
    run_query_steps,
    sweep_messages_steps,
)
from dmq_server.db.schema import migrate
from dmq_server.db.steps import Statement, Steps, run_steps
from dmq_server.db.topics import list_topics_steps
from dmq_server.db.trace import ReturnRow, record_returns_steps
from dmq_server.db.worker import connect

NODE = "node-1"
OWNER = 1  # the first incarnation of a fresh database


def _msg(producer: str, session_id: int, topic: str = "orders", body: bytes | None = None) -> NewMessage:
    return NewMessage(topic, producer, session_id, 0, body if body is not None else f"{producer}{session_id}".encode())


def find_steps(pairs: list[tuple[str, int]]) -> Steps:
    rows = yield Statement("find_messages", {"producers": [p for p, _ in pairs], "session_ids": [s for _, s in pairs]})
    return sorted(rows, key=lambda r: (r[1], r[2]))


def insert_new_steps(batch: list[NewMessage]) -> Steps:
    """The fast insert alone: a stored pair must fail it as a unique violation."""
    params = {
        "topics": [m.topic for m in batch], "producers": [m.producer for m in batch],
        "session_ids": [m.session_id for m in batch], "produced_ms": [0] * len(batch),
        "bodies": [m.body for m in batch], "node_id": NODE, "owner": OWNER,
        "batch_topics": sorted({m.topic for m in batch}),
    }
    try:
        rows = yield Statement("insert_new_messages", params, may_fail=True)
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
    """Message ids as the order they were first seen in (the sequences differ)."""

    def __init__(self) -> None:
        self._alias: dict[int, str] = {}
        self.real: dict[str, int] = {}

    def __call__(self, message_id: int) -> str:
        alias = self._alias.setdefault(message_id, f"m{len(self._alias) + 1}")
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
        ("nothing old enough to sweep", sweep_messages_steps, lambda: (3600, 100), same),
        ("sweep what no channel holds", sweep_messages_steps, lambda: (-60, 100), same),
        ("swept", find_steps, lambda: ([("p", 1), ("p", 2), ("p", 3), ("a", 9), ("q", 1)],), lambda rows: [(r[1], r[2]) for r in rows]),
    ]


def run_script(run: Callable[..., Any]) -> list[tuple[str, Any]]:
    ids = Ids()
    answers = []
    for label, steps_fn, args, view in script(ids):
        try:
            answer = run(steps_fn, *args())
        except StorageError as exc:  # an answer too: which error
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


def _arrange_memory() -> MemoryDb:
    db = MemoryDb()
    db.create_topic("orders", ["billing", "audit"], msg_timeout_ms=60000)
    db.create_topic("quiet", msg_timeout_ms=30000, rate_limit=5)
    return db


def _memory_runner(db: MemoryDb) -> Callable[..., Any]:
    def run(steps_fn: Callable[..., Steps], *args: Any) -> Any:
        out: list[Any] = []
        db.run_steps(steps_fn, *args).addBoth(out.append)
        if hasattr(out[0], "raiseException"):
            out[0].raiseException()
        return out[0]

    return run


def test_the_double_answers_the_script_as_postgresql_does(pg_dsn):
    _arrange_pg(pg_dsn)
    with connect(pg_dsn, autocommit=True) as conn:
        expected = run_script(lambda steps_fn, *args: run_steps(conn, steps_fn(*args)))
    actual = run_script(_memory_runner(_arrange_memory()))
    for (label, want), (_, got) in zip(expected, actual):
        assert got == want, f"{label}: PostgreSQL answered {want!r}, the double {got!r}"
    assert len(actual) == len(expected)


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

"""Priority as a delivery order, the database's side (issue 45 §3, schema version 18).

``load_priority_backlog`` hands a channel its stored, unacknowledged copies of a priority
above 0, highest priority first, then in id order, of each level only the copies after
that level's bound; its index (``dmq_message_priority_idx``, partial: ``priority > 0``)
holds only such messages, so priority-0 sends insert nothing into it.

One scenario runs on real PostgreSQL and on the in-memory double and both must give the
answers written out here (test_memory_db_contract.py compares the two on its own scripts
too). The plan test shows the statement reads the partial index by (topic, owner, level,
id) ranges and never walks the table."""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest

from dmq_client.wire.properties import NO_PROPERTIES, Properties
from dmq_server.db.dead_letter_steps import CopyRef, record_attempts_steps
from dmq_server.db.delays import NewDelayed, insert_delayed_steps, move_due_steps
from dmq_server.db.messages import (
    NOTHING_AHEAD,
    AckRow,
    BacklogRow,
    CursorProgress,
    NewMessage,
    ack_deliveries_steps,
    create_owner_steps,
    insert_messages_steps,
    load_backlog_steps,
    load_priority_backlog_steps,
)
from dmq_server.db.steps import STATEMENTS, run_steps
from dmq_server.db.worker import connect

from .test_memory_db_contract import (
    NODE,
    Kinds,
    _arrange_memory,
    _arrange_pg,
    _memory_runner,
    _pg_runner,
    operators_script,
    rows_steps,
    run_script,
)

pytestmark = pytest.mark.integration

INDEX = "dmq_message_priority_idx"
NONE_YET = [0] * 9  # every level's bound: nothing loaded of it before
LONG_AGO = 1_000  # a due time in 1970


#: the messages of the scenario in store order (so in id order): name, priority, which owner
#: (0: the first incarnation, on NODE; 1: the second, on node-2)
STORED = [("a1", 0, 0), ("a2", 5, 0), ("a3", 9, 0), ("b1", 5, 1), ("b2", 9, 1), ("a4", 5, 0), ("b3", 0, 1),
          ("a5", 1, 0), ("b4", 1, 1), ("a6", 9, 0), ("a7", 5, 0)]


def scenario(run: Callable[..., Any]) -> dict[str, list]:
    """Store the messages of STORED one statement each (so ids follow the list), then load;
    every answer in the scenario's names: (name, priority, attempts) a row."""
    owners = [run(create_owner_steps, NODE), run(create_owner_steps, "node-2")]
    nodes = [NODE, "node-2"]
    ids: dict[str, int] = {}
    for n, (name, priority, which) in enumerate(STORED):
        props = Properties(key=name, priority=priority) if priority else NO_PROPERTIES
        (stored,) = run(insert_messages_steps, [NewMessage("orders", "p", n, 0, name.encode(), props)],
                        nodes[which], owners[which])
        ids[name] = stored.message_id
    names = {message_id: name for name, message_id in ids.items()}

    def bounds(**after: str) -> list[int]:
        """The afters of a load: level p's bound is the id of the message named p<p>=..."""
        return [ids[after[f"p{p}"]] if f"p{p}" in after else 0 for p in range(1, 10)]

    def load(channel: str, afters: list[int], limit: int = 100, holder: str | None = None, owner: int = 0) -> list:
        rows = run(load_priority_backlog_steps, "orders", channel, afters, limit, holder, owner)
        assert all(isinstance(r, BacklogRow) and r.key == names[r.message_id] for r in rows)
        return [(names[r.message_id], r.priority, r.attempts) for r in rows]

    out: dict[str, list] = {"everything": load("billing", NONE_YET)}
    out["limited"] = load("billing", NONE_YET, limit=4)
    out["after each level's bound"] = load("billing", bounds(p9="b2", p5="a4", p1="a1"))
    out["a level loaded to its end"] = load("billing", bounds(p9="a6", p5="a7", p1="b4"))
    out["this node's incarnation"] = load("billing", NONE_YET, holder=NODE, owner=owners[0])
    out["another node's"] = load("billing", NONE_YET, holder="node-2", owner=owners[1])
    # billing acknowledged a1 and a2 (the floor) and a6 (a range above it) of the first owner,
    # b2 of the second; b1 was tried 3 times
    run(ack_deliveries_steps, [AckRow("orders", "billing", ids[n], 1_700_000_000_000, 1_700_000_001_000, 1,
                                      owner=owners[n[0] == "b"]) for n in ("a1", "a2", "a6", "b2")],
        [CursorProgress("orders", "billing", owners[0], ids["a2"], [(ids["a6"], ids["a6"])]),
         CursorProgress("orders", "billing", owners[1], 0, [(ids["b2"], ids["b2"])])], NODE)
    run(record_attempts_steps, [CopyRef("orders", "billing", ids["b1"], 3, owners[1])])
    out["after acks"] = load("billing", NONE_YET)
    out["the other channel"] = load("audit", NONE_YET)
    # the plain backlog carries each copy's priority too
    out["the plain backlog"] = [(names[r.message_id], r.priority)
                                for r in run(load_backlog_steps, "orders", "audit", 0, 100)]
    # a channel registered now starts after every message stored before
    run(rows_steps, "add_channel", {"topic": "orders", "name": "late"})
    (late,) = run(insert_messages_steps, [NewMessage("orders", "p", 99, 0, b"c1", Properties("c1", 3))], NODE,
                  owners[0])
    names[late.message_id] = "c1"
    out["a channel registered later"] = load("late", NONE_YET)
    # a delayed message keeps its priority as it is moved into the flow
    six = Properties("d1", 6)
    run(insert_delayed_steps, [NewDelayed(NewMessage("orders", "dp", 1, 0, b"d1", six), LONG_AGO, 1),
                               NewDelayed(NewMessage("orders", "dp", 2, 0, b"d2"), LONG_AGO, 1)], NODE)
    _, moved = run(move_due_steps, (1,), 1, LONG_AGO, 10, NODE, owners[0])
    names.update({m.message_id: m.body.decode() for m in moved})
    out["moved"] = sorted((m.body.decode(), m.key, m.priority) for m in moved)
    out["moved, loaded"] = load("late", NONE_YET)
    return out


EXPECTED = {
    # priority 0 (a1, b3) never; both owners' copies of a level merged in id order
    "everything": [("a3", 9, 0), ("b2", 9, 0), ("a6", 9, 0), ("a2", 5, 0), ("b1", 5, 0), ("a4", 5, 0), ("a7", 5, 0),
                   ("a5", 1, 0), ("b4", 1, 0)],
    # the limit cuts across levels
    "limited": [("a3", 9, 0), ("b2", 9, 0), ("a6", 9, 0), ("a2", 5, 0)],
    # each level from its own bound (a1, below every level-1 copy, leaves that level whole)
    "after each level's bound": [("a6", 9, 0), ("a7", 5, 0), ("a5", 1, 0), ("b4", 1, 0)],
    "a level loaded to its end": [],
    # in a cluster: a node's own incarnation (and the owners whose cursors it holds: none yet)
    "this node's incarnation": [("a3", 9, 0), ("a6", 9, 0), ("a2", 5, 0), ("a4", 5, 0), ("a7", 5, 0), ("a5", 1, 0)],
    "another node's": [("b2", 9, 0), ("b1", 5, 0), ("b4", 1, 0)],
    # below the floor (a2) and the done ranges (a6, b2): gone; attempts joined
    "after acks": [("a3", 9, 0), ("b1", 5, 3), ("a4", 5, 0), ("a7", 5, 0), ("a5", 1, 0), ("b4", 1, 0)],
    "the other channel": [("a3", 9, 0), ("b2", 9, 0), ("a6", 9, 0), ("a2", 5, 0), ("b1", 5, 0), ("a4", 5, 0),
                          ("a7", 5, 0), ("a5", 1, 0), ("b4", 1, 0)],
    "the plain backlog": [(name, priority) for name, priority, _ in STORED],
    "a channel registered later": [("c1", 3, 0)],
    "moved": [("d1", "d1", 6), ("d2", None, 0)],
    "moved, loaded": [("d1", 6, 0), ("c1", 3, 0)],
}


def test_priority_backlog_on_postgresql(pg_dsn):
    _arrange_pg(pg_dsn)
    with connect(pg_dsn, autocommit=True) as conn:
        assert scenario(_pg_runner(conn)) == EXPECTED


def test_priority_backlog_on_the_double():
    assert scenario(_memory_runner(_arrange_memory())) == EXPECTED


def test_a_replayed_dead_letter_and_a_delayed_message_keep_their_priority(pg_dsn):
    """The operators' contract script moves a delayed message with properties (priority 7)
    and a replayed dead letter (priority 5) into the flow: MovedMessage.priority says so, on
    PostgreSQL (the contract test holds the double to the same answer)."""
    _arrange_pg(pg_dsn)
    with connect(pg_dsn, autocommit=True) as conn:
        answers = dict(run_script(_pg_runner(conn), operators_script, Kinds()))
    _, moved = answers["move what is due"]
    assert sorted((m["producer"], m["priority"]) for m in moved) == [
        ("dmq-replay", 0), ("dmq-replay", 5), ("dp", 0), ("dp", 0), ("dp", 7)]


def test_the_load_reads_the_partial_index_by_ranges(pg_dsn):
    """Each level's read is, for every owner, an index range of dmq_message_priority_idx led
    by the topic's hash and the owner, from the level's id bound to the level's end: the
    priority-0 copies (most of the table), other levels and other topics' messages are not
    walked, nor is the placement index. With statistics taken before the topic's messages
    were stored too (a new topic's first backlog), where the planner expects one row."""
    with connect(pg_dsn, autocommit=True) as conn:
        owners = [run_steps(conn, create_owner_steps(f"node-{n}")) for n in (1, 2)]
        for topic in ("t1", "t2", "t3"):
            conn.execute(STATEMENTS["create_topic"], {"name": topic, "store": "reliable", "msg_timeout_ms": 60000,
                                                      "rate_limit": None, "ttl_ms": None, "max_attempts": None,
                                                      "cluster": "main", "ordered": False, "retention_ms": None})
            conn.execute(STATEMENTS["add_channel"], {"topic": topic, "name": "c"})
            if topic == "t1":
                conn.execute("ANALYZE")  # stale for t1: taken before its messages
            for owner in owners:  # one message in 50 has a priority (1 to 9)
                conn.execute("INSERT INTO dmq_message (topic, producer, session_id, node_id, owner, body, priority) "
                             "SELECT %s, %s, i, 'node', %s, 'x', "
                             "CASE WHEN i %% 50 = 0 THEN 1 + i / 50 %% 9 ELSE 0 END "
                             "FROM generate_series(1, 20000) AS i", (topic, f"p-{topic}-{owner}", owner))
        params = {"topic": "t1", "channel": "c", "limit": 100, "holder": None, "owner": 0, "priority": 7, "after": 0}
        assert set(re.findall(r"%\((\w+)\)s", STATEMENTS["load_priority_level"])) == set(params)
        for statistics in ("stale", "fresh"):
            if statistics == "fresh":
                conn.execute("ANALYZE")
            plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + STATEMENTS["load_priority_level"], params))
            # (an ordered scan of each range, or a bitmap of it sorted: which one is the estimate's)
            assert f"Index Scan using {INDEX} on dmq_message" in plan or f"Bitmap Index Scan on {INDEX}" in plan, plan
            (condition,) = {line.split("Index Cond: ", 1)[1] for line in _after(plan, INDEX) if "Index Cond: " in line}
            # the owner's range of the level: equalities on the hash and the owner, then the level's
            # id bound as a row comparison and the level's end (no equality on the level: only
            # this index gives the statement's order)
            assert re.match(r"\(\(hashtext\(topic\) = -?\d+\) AND \(owner = o\.id\) AND \(ROW\(priority, id\) > "
                            r"ROW\('7'::smallint, GREATEST\('0'::bigint, .*\)\) AND \(priority <= '7'::smallint\)\)$",
                            condition), f"{statistics}:\n{plan}"
            assert "Seq Scan on dmq_message" not in plan and "dmq_message_topic_owner_idx" not in plan, plan
            assert "dmq_message_pkey" not in plan, plan
        # and it answers: the top level's copies of t1 first, both owners' in id order
        rows = run_steps(conn, load_priority_backlog_steps("t1", "c", [0] * 9, 5))
        assert [r.priority for r in rows] == [9] * 5 and [r.message_id for r in rows] == sorted(r.message_id for r in rows)


def _asking(conn, steps) -> tuple[list[tuple[int, int]], list]:
    """Run a read-ahead's steps on ``conn``: the (level, limit) each statement asked, and
    the rows the steps returned."""
    asked, answer = [], None
    try:
        while True:
            statement = steps.send(answer)
            assert statement.name == "load_priority_level"
            asked.append((statement.params["priority"], statement.params["limit"]))
            answer = conn.execute(STATEMENTS[statement.name], statement.params).fetchall()
    except StopIteration as done:
        return asked, done.value


def test_a_read_ahead_stops_at_its_limit(pg_dsn):
    """A read-ahead asks the levels highest first, each for what the levels above left of
    its limit, and no level once the limit is reached (one statement over the nine levels
    read up to the limit of each and sorted them: 45,000 rows read for 5,000 in the
    priority drains). A level bounded above every id is not asked."""
    with connect(pg_dsn, autocommit=True) as conn:
        owner = run_steps(conn, create_owner_steps("node-1"))
        conn.execute(STATEMENTS["create_topic"], {"name": "t1", "store": "reliable", "msg_timeout_ms": 60000,
                                                  "rate_limit": None, "ttl_ms": None, "max_attempts": None,
                                                  "cluster": "main", "ordered": False, "retention_ms": None})
        conn.execute(STATEMENTS["add_channel"], {"topic": "t1", "name": "c"})
        # 30 copies of level 9, 20 of level 8, 10 of level 5, their ids interleaved
        conn.execute("INSERT INTO dmq_message (topic, producer, session_id, node_id, owner, body, priority) "
                     "SELECT 't1', 'p', i, 'node', %s, 'x', (ARRAY[9, 9, 9, 8, 8, 5])[1 + i %% 6] "
                     "FROM generate_series(0, 59) AS i", (owner,))
        asked, rows = _asking(conn, load_priority_backlog_steps("t1", "c", [0] * 9, 45))
        assert asked == [(9, 45), (8, 15)]  # filled: nothing below level 8 asked
        assert [r.priority for r in rows] == [9] * 30 + [8] * 15
        assert all(a.message_id < b.message_id for a, b in zip(rows[:29], rows[1:30]))
        assert all(a.message_id < b.message_id for a, b in zip(rows[30:], rows[31:]))
        after = [0] * 9
        after[9 - 1] = NOTHING_AHEAD  # level 9 has nothing left to read
        after[8 - 1] = rows[-1].message_id  # level 8 read up to its 15th copy
        asked, rows = _asking(conn, load_priority_backlog_steps("t1", "c", after, 100))
        assert asked == [(8, 100), (7, 95), (6, 95), (5, 95), (4, 85), (3, 85), (2, 85), (1, 85)]
        assert [r.priority for r in rows] == [8] * 5 + [5] * 10


def _after(plan: str, index: str) -> list[str]:
    """The lines of the plan's scan of ``index`` up to the next plan node."""
    lines = plan.splitlines()
    start = next(n for n, line in enumerate(lines) if f"using {index} on " in line or f"Index Scan on {index}" in line)
    end = next((n for n in range(start + 1, len(lines)) if "->" in lines[n]), len(lines))
    return lines[start:end]


def test_priority_zero_messages_have_no_entry_in_the_index(pg_dsn):
    """The index is partial: only the rows of a priority above 0 are entries (what keeps the
    send of a message without a priority at its cost)."""
    with connect(pg_dsn, autocommit=True) as conn:
        owner = run_steps(conn, create_owner_steps(NODE))
        conn.execute(STATEMENTS["create_topic"], {"name": "t", "store": "reliable", "msg_timeout_ms": 60000,
                                                  "rate_limit": None, "ttl_ms": None, "max_attempts": None,
                                                  "cluster": "main", "ordered": False, "retention_ms": None})
        batch = [NewMessage("t", "p", n, 0, b"x", Properties(priority=n % 3) if n % 3 else NO_PROPERTIES)
                 for n in range(30)]
        run_steps(conn, insert_messages_steps(batch, NODE, owner))
        (definition,) = conn.execute("SELECT pg_get_indexdef(%s::regclass)", (INDEX,)).fetchone()
        assert definition.endswith("(hashtext(topic), owner, priority, id) WHERE (priority > 0)"), definition
        # ANALYZE counts a partial index's entries among its sample (here every row) as its reltuples
        conn.execute("ANALYZE dmq_message")
        (entries,) = conn.execute("SELECT reltuples FROM pg_class WHERE relname = %s", (INDEX,)).fetchone()
        assert entries == 20

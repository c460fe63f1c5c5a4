"""Schema version 12 (``sql/migrations/0012_message_keys.sql``): dmq_message's resend key is
(session_id, producer) and its placement index (hashtext(topic), owner, id), both led by
fixed-width keys because the send statement inserts into them for every message.

Real PostgreSQL. A statement that reads a topic's messages of one owner must say
``hashtext(m.topic) = hashtext(...)`` or the planner cannot use the index: it still answers
right, by walking the primary key through every topic's messages, so only the plan shows the
mistake. The migration is run on a database holding waiting copies (cursors with acked ranges,
a channel's own message, two owners), which must wait and load exactly as before."""

from __future__ import annotations

import re

from psycopg import sql

import pytest

import registry
from dmq_server.db.messages import (
    NewMessage,
    StoredMessage,
    create_owner_steps,
    insert_messages_steps,
    empty_channel_steps,
    load_backlog_steps,
)
from dmq_server.db.dead_letter_steps import expire_deliveries_steps, open_ttl_cursors_steps
from dmq_server.db.schema import migrate
from dmq_server.db.steps import STATEMENTS, run_steps
from dmq_server.db.worker import connect
from dmq_sql import migrations

from .support import db_rows
from .test_migrate_cursors import _migrate_to

pytestmark = pytest.mark.integration

INDEX = "dmq_message_topic_owner_idx"

#: Every statement that reads one topic's messages of an owner, and the view that does.
BY_TOPIC = ("load_backlog", "open_ttl_cursors", "expire_deliveries", "claim_owners", "prune_owners",
            "empty_channel", "channel_depths", "topic_leftovers", "owner_depths")

PARAMS = {"topic": "t1", "channel": "c", "after": 0, "limit": 100, "holder": None, "owner": 1, "now_ms": 0,
          "owners": [1], "me": "node-2", "dead": "node-1", "live": ["node-2"], "name": "t1", "fenced_at": None,
          "id": 1, "skip_keys": [], "only_key": None, "fenced": False}


def _fill(conn, owners: list[int], per_topic: int, others: int | None = None, schema_11: bool = False) -> None:
    """Topics t1, t2, t3 with a channel c each; ``per_topic`` messages of t1 stored by each
    owner, ``others`` (default the same) of t2 and t3. ``schema_11``: the database is at
    version 11, whose dmq_topic the registry of today no longer writes, nor today's
    insert_messages reads (``ordered``, 17): the rows go in as that version's would."""
    for topic in ("t1", "t2", "t3"):
        if schema_11:
            conn.execute("INSERT INTO dmq_topic (name) VALUES (%s)", (topic,))
            conn.execute(STATEMENTS["add_channel"], {"topic": topic, "name": "c"})
        else:
            registry.create_topic(conn, topic)
            registry.add_channel(conn, topic, "c")
        count = per_topic if topic == "t1" or others is None else others
        for owner in owners:
            if schema_11:
                conn.execute("INSERT INTO dmq_message (topic, producer, session_id, node_id, owner, body) "
                             "SELECT %s, %s, n, %s, %s, 'x' FROM generate_series(0, %s - 1) AS n",
                             (topic, f"p-{owner}-{topic}", f"node-{owner}", owner, count))
                continue
            batch = [NewMessage(topic, f"p-{owner}-{topic}", n, 0, b"x") for n in range(count)]
            run_steps(conn, insert_messages_steps(batch, f"node-{owner}", owner))


def _plan(conn, name: str) -> str:
    params = {key: PARAMS[key] for key in set(re.findall(r"%\((\w+)\)[sb]", STATEMENTS[name]))}
    return "\n".join(r[0] for r in conn.execute("EXPLAIN " + STATEMENTS[name], params).fetchall())


def test_every_statement_reading_a_topic_of_an_owner_uses_the_placement_index(pg_dsn):
    with connect(pg_dsn, autocommit=True) as conn:
        owners = [run_steps(conn, create_owner_steps(f"node-{n}")) for n in (1, 2)]
        # the topic asked about is a small share of the table, as one of many topics is
        _fill(conn, owners, 100, others=5000)
        conn.execute("UPDATE dmq_topic SET ttl_ms = 60000")  # the TTL statements' topics
        conn.execute("ANALYZE")
        # what the planner would take on a large table: no walk of every row
        conn.execute("SET enable_seqscan = off")
        for name in BY_TOPIC:
            plan = _plan(conn, name)
            conditions = _conditions(plan, INDEX)
            assert conditions, f"{name} does not use {INDEX}:\n{plan}"
            # the hash leads each probe (alone, or with the owner and the id bound as a row
            # comparison; or the next entry after them, in the index's order): not a walk of
            # every topic's entries of an owner
            assert all(c.lstrip("(").startswith(("hashtext(topic) = ", "ROW(hashtext(topic), owner, id) > ROW("))
                       for c in conditions), f"{name}:\n{plan}"
            # the primary key only finds one id, it does not walk the table
            assert all(c.startswith("(id = ") for c in _conditions(plan, "dmq_message_pkey")), f"{name}:\n{plan}"
            assert "Seq Scan on dmq_message " not in plan, f"{name}:\n{plan}"


def test_a_topic_that_is_most_of_the_table_is_still_read_by_its_owners_range(pg_dsn):
    """The other shape: t1 is most of the table (200,000 messages a retention keeps, stored
    by one incarnation), the other incarnations stored only t2's. Read from an id near the
    top, each statement reads each owner's range of the placement index from that id; with
    the bound written as ``m.id > X`` the planner walked the primary key from X filtering on
    the owner, every later row for each owner without a row of t1 (a seek's replay of 1 M
    of 10 M retained messages drained at 1,500 msgs/s: docs/benchmarks.md)."""
    with connect(pg_dsn, autocommit=True) as conn:
        owners = [run_steps(conn, create_owner_steps(f"node-{n}")) for n in (1, 2, 3, 4)]
        for topic in ("t1", "t2"):
            registry.create_topic(conn, topic, ttl_ms=60000)
            registry.add_channel(conn, topic, "c")
        conn.execute("INSERT INTO dmq_message (topic, producer, session_id, node_id, owner, body) "
                     "SELECT 't1', 'p', n, 'node-1', %s, 'x' FROM generate_series(1, 200000) AS n", (owners[0],))
        for owner in owners[1:]:
            conn.execute("INSERT INTO dmq_message (topic, producer, session_id, node_id, owner, body) "
                         "SELECT 't2', %s, n, 'node', %s, 'x' FROM generate_series(1, 20000) AS n", (f"p{owner}", owner))
        (top,) = conn.execute("SELECT max(id) FROM dmq_message WHERE topic = 't1'").fetchone()
        conn.execute("UPDATE dmq_channel SET start_id = %s - 1000 WHERE topic = 't1'", (top,))
        conn.execute("ANALYZE")
        params = dict(PARAMS, after=top - 1000, below=top, upto=top, retention_s=0, counted_ms=0)
        # whether an owner stored a message of a topic: a probe per (channel, owner), never a
        # hash of the whole table (an EXISTS was one, each expiry pass, with no TTL topic even),
        # nor a walk of it until a row of the owner turns up (prune_owners did, at each sweep
        # pass's end, for each retired incarnation: 1.5 s of 10 M rows for one whose rows are
        # the newest, bench/retained.py)
        for name in ("open_ttl_cursors", "claim_owners", "open_ordered_cursors", "prune_owners"):
            names = set(re.findall(r"%\((\w+)\)[sb]", STATEMENTS[name]))
            plan = "\n".join(r[0] for r in conn.execute(
                "EXPLAIN " + STATEMENTS[name], {key: params[key] for key in names}).fetchall())
            assert "Seq Scan on dmq_message " not in plan and "using dmq_message_topic_owner_idx" in plan, \
                f"{name}:\n{plan}"
        conn.execute("SET enable_seqscan = off")  # as on a table of millions (the test above)
        for name in BY_TOPIC + ("sweep_topic", "count_retained"):
            names = set(re.findall(r"%\((\w+)\)[sb]", STATEMENTS[name]))
            plan = "\n".join(r[0] for r in conn.execute(
                "EXPLAIN " + STATEMENTS[name], {key: params[key] for key in names}).fetchall())
            assert all(c.startswith("(id = ") for c in _conditions(plan, "dmq_message_pkey")), f"{name}:\n{plan}"
            assert "Seq Scan on dmq_message " not in plan, f"{name}:\n{plan}"


def _generic_plan(conn, name: str, params: dict) -> str:
    """``name``'s generic plan (what a server's prepared statement runs from its sixth
    execution on) for ``params``: PREPARE'd with $n, EXPLAIN EXECUTE'd."""
    order: list[str] = []

    def number(match: re.Match) -> str:
        if match.group(1) not in order:
            order.append(match.group(1))
        return f"${order.index(match.group(1)) + 1}"

    text = re.sub(r"%\((\w+)\)[sb]", number, STATEMENTS[name])

    def sql_type(value: object) -> str:
        if isinstance(value, bool):
            return "boolean"
        if isinstance(value, list):
            return "bigint[]" if all(isinstance(v, int) for v in value) else "text[]"
        return {int: "bigint", float: "double precision"}.get(type(value), "text")

    conn.execute("DEALLOCATE ALL")
    conn.execute("SET plan_cache_mode = force_generic_plan")
    conn.execute(f"PREPARE probe ({', '.join(sql_type(params[key]) for key in order)}) AS {text}")
    try:
        # (literals: a utility statement takes no parameters)
        args = sql.SQL(", ").join(sql.SQL("{}::" + sql_type(params[key])).format(sql.Literal(params[key]))
                                  for key in order)
        return "\n".join(r[0] for r in conn.execute(
            sql.SQL("EXPLAIN EXECUTE probe({})").format(args)).fetchall())
    finally:
        conn.execute("RESET plan_cache_mode")


def test_a_new_incarnation_reads_a_topic_by_its_range_in_a_generic_plan(pg_dsn):
    """A second run on a database: the first incarnation stored 500,000 messages of t2, then
    300,000 of t1, all acknowledged, the second none yet. Each reading statement's generic
    plan reads the placement index's ranges only. (With the statistics of a benchmark's
    second round, the load's generic plan walked the primary key from the first id,
    filtering on everything: 0.6 s a load, e2e at 4,000 msgs/s against 40,000; these rows
    do not bring that plan back with the text it had: the test keeps the property.)"""
    with connect(pg_dsn, autocommit=True) as conn:
        first, second = (run_steps(conn, create_owner_steps(f"node-{n}")) for n in (1, 2))
        for topic, count in (("t2", 500_000), ("t1", 300_000)):
            registry.create_topic(conn, topic, ttl_ms=60000)
            registry.add_channel(conn, topic, "c")
            conn.execute("INSERT INTO dmq_message (topic, producer, session_id, node_id, owner, body) "
                         "SELECT %s, %s, n, 'node-1', %s, 'x' FROM generate_series(1, %s) AS n", (topic, topic, first, count))
        (top,) = conn.execute("SELECT max(id) FROM dmq_message").fetchone()
        conn.execute("INSERT INTO dmq_cursor (topic, channel, owner, holder, floor) VALUES ('t1', 'c', %s, '', %s)",
                     (first, top))
        conn.execute("VACUUM ANALYZE dmq_message")
        params = dict(PARAMS, after=top, below=top, upto=top, retention_s=0, counted_ms=0, owner=second,
                      priority=5)
        for name in ("load_backlog", "load_priority_level", "sweep_topic", "count_retained", "expire_deliveries"):
            plan = _generic_plan(conn, name, params)
            assert all(c.startswith("(id = ") for c in _conditions(plan, "dmq_message_pkey")), f"{name}:\n{plan}"
            assert "Seq Scan on dmq_message " not in plan, f"{name}:\n{plan}"
            # each probe of the placement index led by the topic's hash (an owner's range, or the
            # loose scan of the owners)
            assert all(c.lstrip("(").startswith(("hashtext(topic) = ", "ROW(hashtext(topic), owner, id) > ROW("))
                       for c in _conditions(plan, INDEX)), f"{name}:\n{plan}"
            # and a level's read: an owner's range of that level, of the priority index
            levels = _conditions(plan, "dmq_message_priority_idx")
            assert bool(levels) == (name == "load_priority_level"), f"{name}:\n{plan}"
            assert all(c.startswith("((hashtext(topic) = hashtext($1)) AND (owner = ") for c in levels), \
                f"{name}:\n{plan}"


def test_a_topic_newer_than_the_statistics_is_loaded_by_an_ordered_scan(pg_dsn):
    """A topic filled after the last ANALYZE (autovacuum has not caught up: a new topic's
    first backlog): the planner expects one matching row. With the owner's range as row
    comparisons alone it read the whole range with a bitmap heap scan and sorted it for
    a probe of 16 rows (the priority drains of bench/reliable.py: `load_backlog` 10.5 ->
    118 ms a call); the equalities beside them keep the ordered index scan, which stops at
    the limit."""
    with connect(pg_dsn, autocommit=True) as conn:
        owner = run_steps(conn, create_owner_steps("node-1"))
        registry.create_topic(conn, "t1")
        registry.add_channel(conn, "t1", "c")
        conn.execute("ANALYZE")  # before the fill
        conn.execute("INSERT INTO dmq_message (topic, producer, session_id, node_id, owner, body, priority) "
                     "SELECT 't1', 'p', n, 'node-1', %s, 'x', n %% 10 FROM generate_series(1, 50000) AS n", (owner,))
        params = dict(PARAMS, limit=16, owner=owner)
        names = set(re.findall(r"%\((\w+)\)[sb]", STATEMENTS["load_backlog"]))
        plan = "\n".join(r[0] for r in conn.execute(
            "EXPLAIN " + STATEMENTS["load_backlog"], {key: params[key] for key in names}).fetchall())
        assert f"Index Scan using {INDEX} on dmq_message" in plan, plan
        assert "Bitmap Heap Scan on dmq_message" not in plan, plan
        # (the priority read-ahead's plan under stale statistics: test_priority_backlog.py)
        rows = run_steps(conn, load_backlog_steps("t1", "c", 0, 16))
        assert [r.message_id for r in rows] == sorted(r.message_id for r in rows) and len(rows) == 16


@pytest.mark.parametrize("analyzed", ["before the fill", "after the fill"])
def test_an_expiry_pass_reads_a_channel_only_up_to_its_limit(pg_dsn, analyzed):
    """A topic with a time to live and 20,000 copies waiting, none expired yet, beside
    another topic's 20,000 (stored before it and analyzed, or interleaved with it): a pass
    reads the cursor's first ``limit`` copies in id order from the placement index and
    stops there. (With the time to live
    tested in the scan, a pass that found nothing read every waiting copy: 126-146 ms a
    pass at 200,000. With the range's equalities beside its row comparisons and fresh
    statistics, the planner walked the primary key from the floor through the other
    topic's ids; with the limit as a constant, it read the whole range by a bitmap heap
    scan and sorted it.) Once they are past the time to live, a pass takes the first
    ``limit`` of them, in id order."""
    limit = 500
    with connect(pg_dsn, autocommit=True) as conn:
        owner = run_steps(conn, create_owner_steps("node-1"))
        registry.create_topic(conn, "t1", ttl_ms=3_600_000)
        registry.create_topic(conn, "t2")
        for topic in ("t1", "t2"):
            registry.add_channel(conn, topic, "c")
        fill = ("INSERT INTO dmq_message (topic, producer, session_id, node_id, owner, body) "
                "SELECT %s, %s, n, 'node-1', %s, convert_to(repeat('x', 200), 'UTF8') FROM generate_series(%s::int, %s::int) AS n")
        if analyzed == "before the fill":  # t2's rows known to the statistics, t1's not
            conn.execute(fill, ("t2", "t2", owner, 1, 20000))
            conn.execute("ANALYZE")
            conn.execute(fill, ("t1", "t1", owner, 1, 20000))
        else:  # the two topics' ids interleaved: the primary key from t1's floor passes t2's too
            conn.execute(fill.replace("SELECT %s,", "SELECT CASE WHEN n %% 2 = 0 THEN %s ELSE 't2' END,"),
                         ("t1", "p", owner, 1, 40000))
            conn.execute("ANALYZE")
        (now_ms,) = conn.execute("SELECT (extract(epoch FROM now()) * 1000)::bigint").fetchone()
        assert run_steps(conn, open_ttl_cursors_steps()) == 1
        assert run_steps(conn, expire_deliveries_steps(now_ms, limit)) == []
        conn.execute("BEGIN")
        plan = "\n".join(r[0] for r in conn.execute(
            "EXPLAIN (ANALYZE) " + STATEMENTS["expire_deliveries"],
            {"now_ms": now_ms, "limit": limit, "holder": "", "fenced": False}).fetchall())
        conn.execute("ROLLBACK")
        scans = [line for line in plan.splitlines() if " on dmq_message " in line]
        assert len(scans) == 1 and f"Index Scan using {INDEX} on dmq_message" in scans[0], plan
        read = int(re.search(r"actual time=\S+ rows=(\d+) ", scans[0]).group(1))
        assert read == limit, plan
        later = now_ms + 3_600_000 + 1
        rows = run_steps(conn, expire_deliveries_steps(later, limit))
        first = [i for (i,) in conn.execute(
            "SELECT id FROM dmq_message WHERE topic = 't1' ORDER BY id LIMIT %s", (limit,)).fetchall()]
        assert [(t, c) for t, c, _ in rows] == [("t1", "c")] * limit
        assert [i for _, _, i in rows] == first


def _conditions(plan: str, index: str) -> list[str]:
    """The index condition of each scan of ``index`` in an EXPLAIN text."""
    lines = plan.splitlines()
    return [next((c.split("Index Cond: ", 1)[1] for c in lines[at + 1:] if "Index Cond: " in c), "")
            for at, line in enumerate(lines) if f"using {index} on " in line or line.endswith(f"Scan on {index}")
            or f"Scan on {index}  (" in line]


def test_the_resend_key_leads_with_the_session_id(pg_dsn):
    (definition,) = db_rows(
        pg_dsn, "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = 'dmq_message_session_producer_key'")
    assert definition == ("UNIQUE (session_id, producer)",)
    with connect(pg_dsn, autocommit=True) as conn:
        owner = run_steps(conn, create_owner_steps("node-1"))
        _fill(conn, [owner], 3)
        # a resend is found by the reordered key: the stored id, nothing inserted
        first = run_steps(conn, insert_messages_steps([NewMessage("t1", f"p-{owner}-t1", 1, 0, b"again")], "node-1", owner))
        (count,) = db_rows(pg_dsn, "SELECT count(*) FROM dmq_message")
        assert count == (9,)
        (stored,) = db_rows(pg_dsn, "SELECT id, body FROM dmq_message WHERE producer = %s AND session_id = 1 "
                                    "AND topic = 't1'", f"p-{owner}-t1")
        assert isinstance(first[0], StoredMessage) and first[0].message_id == stored[0] and bytes(stored[1]) == b"x"
        # the same number from another producer is another message
        other = run_steps(conn, insert_messages_steps([NewMessage("t1", "q", 1, 0, b"y")], "node-1", owner))
        assert other[0].message_id > stored[0]


def _waiting(dsn: str) -> list[tuple]:
    return db_rows(dsn, "SELECT topic, channel, message_id, owner FROM dmq_pending ORDER BY 1, 2, 3")


def test_the_migration_keeps_every_waiting_copy(pg_empty_dsn):
    _migrate_to(pg_empty_dsn, 11)
    with connect(pg_empty_dsn, autocommit=True) as conn:
        owners = [run_steps(conn, create_owner_steps(f"node-{n}")) for n in (1, 2)]
        _fill(conn, owners, 40, schema_11=True)
        conn.execute(STATEMENTS["add_channel"], {"topic": "t1", "name": "d"})
        ids = [r[0] for r in conn.execute("SELECT id FROM dmq_message WHERE topic = 't1' AND owner = %s "
                                          "ORDER BY id", (owners[0],)).fetchall()]
        # channel c of t1 acknowledged a prefix and a range above it; d nothing (the cursor as
        # schema 11 holds it: today's ack statement reads columns of later versions)
        acked = ids[:10] + ids[20:25]
        conn.execute("INSERT INTO dmq_cursor (topic, channel, owner, holder, floor, done) "
                     "VALUES ('t1', 'c', %s, '', %s, int8multirange(int8range(%s, %s, '[]')))",
                     (owners[0], ids[9], ids[20], ids[24]))
        # a message for channel d alone (as a replayed dead letter is stored)
        conn.execute("INSERT INTO dmq_message (topic, producer, session_id, node_id, owner, channel, body) "
                     "VALUES ('t1', 'replay', 1, 'node-1', %s, 'd', 'r')", (owners[0],))
    before = _waiting(pg_empty_dsn)
    assert len(before) == 3 * 2 * 40 - len(acked) + 1  # every c's copies less the acked ones, and d's own

    assert migrate(pg_empty_dsn) == [v for v, _, _ in migrations() if v > 11]

    assert _waiting(pg_empty_dsn) == before
    with connect(pg_empty_dsn, autocommit=True) as conn:
        # today's loads (which read columns of later versions) find exactly the copies waiting before
        for topic in ("t1", "t2"):
            for channel in ("c", "d"):
                loaded = run_steps(conn, load_backlog_steps(topic, channel, 0, 1000))
                assert [r.message_id for r in loaded] == [r[2] for r in before if r[:2] == (topic, channel)]
        # resends of stored pairs are still found, a new pair is stored
        again = run_steps(conn, insert_messages_steps(
            [NewMessage("t1", f"p-{owners[0]}-t1", 3, 0, b"x"), NewMessage("t1", f"p-{owners[0]}-t1", 40, 0, b"new")],
            "node-1", owners[0]))
        assert again[0].message_id == ids[3] and again[1].message_id > max(ids)
    assert [r[2] for r in _waiting(pg_empty_dsn) if r[:2] == ("t1", "c")][-1] == again[1].message_id


def test_a_topic_sharing_a_hash_reads_only_its_own_messages(pg_dsn):
    """Two topic names with one hashtext value share the index's entries; the text
    comparison next to the hash keeps them apart."""
    first, second = COLLIDING
    with connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT hashtext(%s) = hashtext(%s)", (first, second)).fetchone() == (True,)
        owner = run_steps(conn, create_owner_steps("node-1"))
        for topic in (first, second):
            registry.create_topic(conn, topic)
            registry.add_channel(conn, topic, "c")
        run_steps(conn, insert_messages_steps([NewMessage(first, "p", n, 0, b"1") for n in range(5)], "n", owner))
        run_steps(conn, insert_messages_steps([NewMessage(second, "p", n + 5, 0, b"2") for n in range(3)], "n", owner))
        assert {r.body for r in run_steps(conn, load_backlog_steps(first, "c", 0, 100))} == {b"1"}
        assert {r.body for r in run_steps(conn, load_backlog_steps(second, "c", 0, 100))} == {b"2"}
        depths = {(t, c): n for t, c, n in conn.execute(STATEMENTS["channel_depths"]).fetchall()}
        assert depths == {(first, "c"): 5, (second, "c"): 3}
        # a channel emptied on one leaves the other's copies waiting
        run_steps(conn, empty_channel_steps(first, "c"))
        depths = {(t, c): n for t, c, n in conn.execute(STATEMENTS["channel_depths"]).fetchall()}
        assert depths == {(second, "c"): 3}


#: Two names with one hashtext value, found by grouping hashtext('topic-' || i) for i up to
#: 400,000 (a birthday search over 32 bits; the test checks the pair still collides).
COLLIDING = ("topic-168169", "topic-374847")


def test_a_retired_incarnation_goes_once_no_message_of_a_topic_is_left(pg_dsn):
    """prune_owners (a sweep pass's end): a retired incarnation with a message of a topic
    stays, wherever in the table the message is; one with none goes, with its cursors; a
    live one stays; messages of a topic no longer registered keep nothing."""
    from dmq_server.db.messages import prune_owners_steps

    with connect(pg_dsn, autocommit=True) as conn:
        kept_old, kept_new, gone, gone_unregistered, live = (
            run_steps(conn, create_owner_steps(f"node-{n}")) for n in range(5))
        for topic in ("t1", "t2"):
            registry.create_topic(conn, topic)
            registry.add_channel(conn, topic, "c")
        run_steps(conn, insert_messages_steps([NewMessage("t1", "p", n, 0, b"x") for n in range(3)], "n", kept_old))
        run_steps(conn, insert_messages_steps([NewMessage("t1", "q", n, 0, b"x") for n in range(3)], "n", gone))
        run_steps(conn, insert_messages_steps([NewMessage("t2", "r", n, 0, b"x") for n in range(3)], "n", kept_new))
        run_steps(conn, insert_messages_steps([NewMessage("t3", "s", n, 0, b"x") for n in range(3)], "n",
                                              gone_unregistered))
        conn.execute("DELETE FROM dmq_message WHERE owner = %s", (gone,))  # swept
        for owner in (kept_old, kept_new, gone):
            conn.execute("INSERT INTO dmq_cursor (topic, channel, owner, holder, floor) VALUES ('t1', 'c', %s, '', 0)",
                         (owner,))
        conn.execute("UPDATE dmq_owner SET retired_at = now() WHERE id <> %s", (live,))
        assert run_steps(conn, prune_owners_steps()) >= 0
        assert {r[0] for r in conn.execute("SELECT id FROM dmq_owner")} == {kept_old, kept_new, live}
        assert {r[0] for r in conn.execute("SELECT owner FROM dmq_cursor")} == {kept_old, kept_new}

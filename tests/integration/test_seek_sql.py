"""The seek's SQL on PostgreSQL (issue 46: ``db.seek``): after a seek the channel's waiting
copies (``dmq_pending``) are exactly the messages of the target on, counted as the seek
answers, and the other channels are untouched; the search of a time is exact while ids
and publish times disagree by up to the skew."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from datetime import datetime, timezone

import psycopg
import pytest

import registry
from dmq_server.db.messages import (
    MAX_ID,
    AckRow,
    CursorProgress,
    NewMessage,
    SweepTarget,
    ack_deliveries_steps,
    create_owner_steps,
    insert_messages_steps,
    sweep_topic_steps,
)
from dmq_server.db.seek import (
    SEEK_SKEW_MS,
    BeforeRetainedStart,
    NoSuchChannel,
    PastTimeToLive,
    SeekInFuture,
    SeekTarget,
    Sought,
    ToId,
    ToLatest,
    ToTime,
    seek_bounds_steps,
    seek_channel_steps,
)
from dmq_server.db.steps import run_steps
from dmq_server.db.worker import connect

from .support import wait_for

pytestmark = pytest.mark.integration

HOUR_MS = 3_600_000


@dataclass
class Stored:
    """A topic's messages: id -> publish time (ms), and id -> incarnation."""

    topic: str
    times: dict[int, int]
    owners: dict[int, int]

    def from_time(self, ms: int) -> set[int]:
        return {i for i, t in self.times.items() if t >= ms}

    def from_id(self, first: int) -> set[int]:
        return {i for i in self.times if i >= first}


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def _now_ms(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT (extract(epoch FROM now()) * 1000)::bigint").fetchone()[0]


def _owners(conn: psycopg.Connection, *nodes: str) -> list[int]:
    return [run_steps(conn, create_owner_steps(node)) for node in nodes]


def _store(conn: psycopg.Connection, topic: str, owners: list[int], count: int, start_ms: int, step_ms: int = 1000,
           jitter_ms: int = 0, rng: random.Random | None = None) -> Stored:
    """``count`` messages of ``topic``, one a statement, the incarnations taking turns; the
    i-th (in id order) published at start + i * step, less up to ``jitter_ms`` (below the
    skew: an id drawn later than another was never published more than that earlier)."""
    ids: dict[int, int] = {}
    for n in range(count):
        owner = owners[n % len(owners)]
        (stored,) = run_steps(conn, insert_messages_steps(
            [NewMessage(topic, f"p-{topic}", n, 0, b"x")], f"node-{owner}", owner))
        ids[stored.message_id] = owner
    times = {}
    for i, message_id in enumerate(sorted(ids)):
        times[message_id] = start_ms + i * step_ms - (rng.randint(0, jitter_ms) if rng and jitter_ms else 0)
    conn.execute(
        "UPDATE dmq_message m SET published_at = timestamptz 'epoch' + u.ms * interval '1 millisecond' "
        "FROM unnest(%s::bigint[], %s::bigint[]) AS u(id, ms) WHERE m.id = u.id",
        (list(times), list(times.values())))
    return Stored(topic, times, ids)


def _ack_all(conn: psycopg.Connection, stored: Stored, channel: str, holder: str | None = None) -> None:
    """Every message acknowledged on ``channel``, each incarnation's cursor held by its own
    node (or ``holder``)."""
    for owner in sorted(set(stored.owners.values())):
        mine = sorted(i for i, o in stored.owners.items() if o == owner)
        acks = [AckRow(stored.topic, channel, i, 1, 2, 1, owner=owner) for i in mine]
        progress = [CursorProgress(stored.topic, channel, owner, mine[-1], [])]
        assert run_steps(conn, ack_deliveries_steps(acks, progress, holder or f"node-{owner}")) == []


def _pending(conn: psycopg.Connection, topic: str, channel: str) -> set[int]:
    return {r[0] for r in conn.execute(
        "SELECT message_id FROM dmq_pending WHERE topic = %s AND channel = %s", (topic, channel)).fetchall()}


def _seek(conn: psycopg.Connection, topic: str, channel: str, target: SeekTarget, dry_run: bool = False,
          skew_ms: int = SEEK_SKEW_MS) -> Sought:
    with conn.transaction():
        return run_steps(conn, seek_channel_steps(topic, channel, target, dry_run, skew_ms))


def _state(conn: psycopg.Connection, topic: str) -> tuple[list[tuple], list[tuple], list[tuple]]:
    """Everything a seek may write: channels, cursors, attempts."""
    return (
        conn.execute("SELECT name, start_id, epoch FROM dmq_channel WHERE topic = %s ORDER BY name", (topic,)).fetchall(),
        conn.execute("SELECT channel, owner, holder, floor, done::text, epoch FROM dmq_cursor WHERE topic = %s "
                     "ORDER BY channel, owner", (topic,)).fetchall(),
        conn.execute("SELECT channel, message_id, attempts FROM dmq_attempts WHERE topic = %s ORDER BY 1, 2",
                     (topic,)).fetchall(),
    )


@pytest.fixture
def world(pg_dsn):
    """Topic orders with channels billing and audit, 120 messages of two incarnations
    published a second apart two hours ago (with a skew of up to 29 s), all acknowledged on
    both channels."""
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders")
        registry.add_channel(conn, "orders", "billing")
        registry.add_channel(conn, "orders", "audit")
        owners = _owners(conn, "node-1", "node-2")
        stored = _store(conn, "orders", owners, 120, _now_ms(conn) - 2 * HOUR_MS, jitter_ms=29_000,
                        rng=random.Random(46))
        _ack_all(conn, stored, "billing")
        _ack_all(conn, stored, "audit")
        assert _pending(conn, "orders", "billing") == set() == _pending(conn, "orders", "audit")
        yield conn, stored


def test_a_seek_to_a_time_makes_exactly_the_messages_published_from_then_on_wait_again(world):
    conn, stored = world
    ordered = sorted(stored.times)
    # five messages are audit's alone (replays stored for one channel): never billing's
    audit_only = set(ordered[55:65:2])
    conn.execute("UPDATE dmq_message SET channel = 'audit' WHERE id = ANY(%s)", (list(audit_only),))
    middle = stored.times[ordered[60]]
    expected = stored.from_time(middle) - audit_only
    assert len(stored.from_time(middle) & audit_only) > 0
    # the skew is real: some message of a lower id was published at or after it, and of a higher one before
    assert any(i < ordered[60] for i in expected) and any(i > ordered[60] for i in set(stored.times) - expected)
    before = _state(conn, "orders")

    dry = _seek(conn, "orders", "billing", ToTime(middle), dry_run=True)
    assert _state(conn, "orders") == before  # a dry run writes nothing
    assert (dry.count, dry.top, dry.epoch, dry.previous_id) == (len(expected), ordered[-1], None, None)

    done = _seek(conn, "orders", "billing", ToTime(middle))
    assert _pending(conn, "orders", "billing") == expected
    assert _pending(conn, "orders", "audit") == set()
    assert (done.count, done.top, done.epoch) == (len(expected), ordered[-1], 1)
    assert (done.target_id, done.target_ms) == (min(expected), stored.times[min(expected)])
    assert dataclass_fields(done, "count", "top", "target_id", "target_ms") == \
        dataclass_fields(dry, "count", "top", "target_id", "target_ms")
    channels, cursors, _ = _state(conn, "orders")
    assert [(name, epoch) for name, _, epoch in channels] == [("audit", 0), ("billing", 1)]
    assert {(channel, epoch) for channel, _, _, _, _, epoch in cursors} == {("audit", 0), ("billing", 1)}

    # again: absolute, not merged (the copies waiting now are the seek's, whatever waited)
    later = stored.times[ordered[100]]
    again = _seek(conn, "orders", "billing", ToTime(later))
    assert _pending(conn, "orders", "billing") == stored.from_time(later)
    assert (again.epoch, again.previous_id) == (2, min(expected))
    assert again.previous_ms == stored.times[min(expected)]
    earlier = _seek(conn, "orders", "billing", ToTime(stored.times[ordered[10]]))
    assert _pending(conn, "orders", "billing") == stored.from_time(stored.times[ordered[10]]) - audit_only
    assert earlier.count == len(stored.from_time(stored.times[ordered[10]]) - audit_only)


def dataclass_fields(value: Sought, *names: str) -> tuple:
    return tuple(getattr(value, n) for n in names)


def test_the_search_of_a_time_is_exact_for_any_skew_below_the_bound(pg_dsn):
    """The property: for messages whose ids and publish times disagree by less than the
    skew (in any way: a random draw of three topics), every seek to a time leaves waiting
    exactly the messages published at or after it, the edges included (before everything,
    after everything). A seek that assumes half the skew is wrong for some of these times:
    the rows use the whole bound."""
    rng = random.Random(4646)
    with connect(pg_dsn, autocommit=True) as conn:
        owners = _owners(conn, "node-1", "node-2", "node-3")
        now = _now_ms(conn)
        start = now - HOUR_MS
        wrong_with_less = 0
        for round_ in range(3):
            topic = f"skewed{round_}"
            registry.create_topic(conn, topic)
            registry.add_channel(conn, topic, "c")
            step = rng.choice((50, 400, 2000))
            # the search reads every topic's rows: each topic's after the one stored before
            stored = _store(conn, topic, owners, 150, start, step_ms=step, jitter_ms=SEEK_SKEW_MS - 1, rng=rng)
            start += 150 * step
            _ack_all(conn, stored, "c")
            lowest, highest = min(stored.times.values()), max(stored.times.values())
            times = [lowest - 60_000, lowest, highest, highest + 1, now]
            times += [rng.randint(lowest, highest) for _ in range(25)]
            times += [stored.times[rng.choice(list(stored.times))] for _ in range(10)]
            for ms in times:
                sought = _seek(conn, topic, "c", ToTime(ms))
                expected = stored.from_time(ms)
                assert _pending(conn, topic, "c") == expected, (topic, ms)
                assert sought.count == len(expected)
                _seek(conn, topic, "c", ToTime(ms), skew_ms=SEEK_SKEW_MS // 2)
                wrong_with_less += _pending(conn, topic, "c") != expected
        assert wrong_with_less > 0


def test_the_bounds_around_a_time(pg_dsn):
    """seek_bounds_steps: lo published at or before T - S, hi at or after T + S, none on
    an empty table or past either end, and the window between them small."""
    with connect(pg_dsn, autocommit=True) as conn:
        assert run_steps(conn, seek_bounds_steps(1_700_000_000_000)).lo is None
        registry.create_topic(conn, "orders")
        (owner,) = _owners(conn, "node-1")
        start = _now_ms(conn) - HOUR_MS
        stored = _store(conn, "orders", [owner], 600, start, step_ms=1000)
        ids = sorted(stored.times)
        bounds = run_steps(conn, seek_bounds_steps(start + 300_000))
        assert stored.times[bounds.lo] <= start + 300_000 - SEEK_SKEW_MS
        assert stored.times[bounds.hi] >= start + 300_000 + SEEK_SKEW_MS
        assert len([i for i in ids if bounds.lo < i < bounds.hi]) < 2 * SEEK_SKEW_MS // 1000 + 10
        before = run_steps(conn, seek_bounds_steps(start - HOUR_MS))
        assert (before.lo, before.hi) == (None, ids[0])
        after = run_steps(conn, seek_bounds_steps(start + 2 * HOUR_MS))
        assert (after.lo, after.hi) == (ids[-1], None)


def test_a_seek_to_an_id_and_to_the_latest(world):
    conn, stored = world
    ordered = sorted(stored.times)
    sought = _seek(conn, "orders", "billing", ToId(ordered[30]))
    assert _pending(conn, "orders", "billing") == stored.from_id(ordered[30])
    assert (sought.count, sought.target_id, sought.epoch) == (90, ordered[30], 1)
    assert _pending(conn, "orders", "audit") == set()

    dry = _seek(conn, "orders", "billing", ToLatest(), dry_run=True)
    assert (dry.count, dry.previous_id, dry.epoch) == (0, ordered[30], None)
    assert _pending(conn, "orders", "billing") == stored.from_id(ordered[30])
    latest = _seek(conn, "orders", "billing", ToLatest())
    assert _pending(conn, "orders", "billing") == set()
    assert (latest.count, latest.target_id, latest.previous_id, latest.epoch) == (0, None, ordered[30], 2)
    # an id above everything stored: nothing waits, and what is stored next does
    beyond = _seek(conn, "orders", "billing", ToId(ordered[-1] + 1))
    assert (beyond.count, _pending(conn, "orders", "billing")) == (0, set())
    (new,) = run_steps(conn, insert_messages_steps([NewMessage("orders", "later", 1, 0, b"x")], "node-1",
                                                    stored.owners[ordered[0]]))
    assert _pending(conn, "orders", "billing") == {new.message_id}


def test_a_channel_registered_after_the_messages_is_sought_back_to_them(world):
    """Its start_id comes down to the floor: what was stored before it existed is its own."""
    conn, stored = world
    registry.add_channel(conn, "orders", "late")
    assert _pending(conn, "orders", "late") == set()
    middle = stored.times[sorted(stored.times)[50]]
    sought = _seek(conn, "orders", "late", ToTime(middle))
    assert _pending(conn, "orders", "late") == stored.from_time(middle)
    assert sought.count == len(stored.from_time(middle))


def test_a_new_cursor_row_is_held_where_its_incarnation_is_delivered(pg_dsn):
    """A cursor the seek opens is held by the node holding that incarnation's cursor of
    another channel of the topic, else any cursor of it, else its own node; an existing
    cursor keeps its holder."""
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders")
        for channel in ("billing", "audit", "zeta"):
            registry.add_channel(conn, "orders", channel)
        registry.create_topic(conn, "clicks")
        registry.add_channel(conn, "clicks", "stats")
        o1, o2, o3, o4 = _owners(conn, "node-1", "node-2", "node-3", "node-4")
        stored = _store(conn, "orders", [o1, o2, o3, o4], 8, _now_ms(conn) - HOUR_MS)
        clicks = _store(conn, "clicks", [o2], 2, _now_ms(conn) - HOUR_MS)
        # o1's cursors of the topic, audit's by node-9 (a takeover), zeta's by node-8;
        # o2's only cursor: of another topic, by node-7; o3 and o4: none (o4 already on billing)
        for channel, holder in (("audit", "node-9"), ("zeta", "node-8")):
            _ack_all(conn, Stored("orders", stored.times, {i: o for i, o in stored.owners.items() if o == o1}),
                     channel, holder)
        _ack_all(conn, clicks, "stats", "node-7")
        # o1's cursor of another topic, first in name order: not the one that names its holder
        conn.execute("INSERT INTO dmq_cursor (topic, channel, owner, holder, floor) VALUES ('clicks', 'stats', %s, "
                     "'node-5', 0)", (o1,))
        _ack_all(conn, Stored("orders", stored.times, {i: o for i, o in stored.owners.items() if o == o4}),
                 "billing", "node-6")
        _seek(conn, "orders", "billing", ToId(1))
        holders = dict(conn.execute(
            "SELECT owner, holder FROM dmq_cursor WHERE topic = 'orders' AND channel = 'billing'").fetchall())
        assert holders == {o1: "node-9", o2: "node-7", o3: "node-3", o4: "node-6"}
        assert _pending(conn, "orders", "billing") == set(stored.times)


def test_a_seek_drops_the_attempts_kept_above_its_floor(world):
    conn, stored = world
    ordered = sorted(stored.times)
    conn.execute("INSERT INTO dmq_attempts (topic, channel, message_id, attempts) "
                 "SELECT 'orders', c, i, 3 FROM unnest(%s::text[]) AS c, unnest(%s::bigint[]) AS i",
                 (["billing", "audit"], [ordered[9], ordered[10], ordered[50]]))
    _seek(conn, "orders", "billing", ToId(ordered[10]))
    _, _, attempts = _state(conn, "orders")
    assert attempts == [("audit", ordered[9], 3), ("audit", ordered[10], 3), ("audit", ordered[50], 3),
                        ("billing", ordered[9], 3)]
    # a dry run drops nothing
    _seek(conn, "orders", "audit", ToId(ordered[0]), dry_run=True)
    assert len(_state(conn, "orders")[2]) == 4


def test_a_seek_before_the_retained_start_is_refused_naming_the_time(world):
    conn, stored = world
    ordered = sorted(stored.times)
    # the retention sweep removes what was published over 2 hours less a minute ago (all acknowledged)
    swept = run_steps(conn, sweep_topic_steps(SweepTarget("orders", 2 * 3600 - 60, MAX_ID), 1000))
    assert swept is not None and 0 < swept[0] < len(ordered)
    gone_ms, gone_id = conn.execute("SELECT swept_ms, swept_id FROM dmq_retention WHERE topic = 'orders'").fetchone()
    kept = [r[0] for r in conn.execute("SELECT id FROM dmq_message ORDER BY id").fetchall()]
    with pytest.raises(BeforeRetainedStart) as refused:
        _seek(conn, "orders", "billing", ToTime(gone_ms))
    assert refused.value.swept_ms == gone_ms and refused.value.oldest_id == kept[0]
    assert "--from-archive" in str(refused.value)
    assert _iso(gone_ms) in str(refused.value) and _iso(stored.times[kept[0]]) in str(refused.value)
    with pytest.raises(BeforeRetainedStart):
        _seek(conn, "orders", "billing", ToId(gone_id))
    assert [epoch for _, _, epoch in _state(conn, "orders")[0]] == [0, 0]
    assert _pending(conn, "orders", "billing") == set()  # nothing written
    assert _seek(conn, "orders", "billing", ToTime(gone_ms + 1)).count == len(
        [i for i in stored.from_time(gone_ms + 1) if i in set(kept)])
    assert _seek(conn, "orders", "billing", ToId(gone_id + 1)).epoch == 2


def test_a_seek_into_the_future_past_a_time_to_live_or_of_no_channel_is_refused(pg_dsn):
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders", ttl_ms=600_000)
        registry.add_channel(conn, "orders", "billing")
        now = _now_ms(conn)
        with pytest.raises(SeekInFuture):
            _seek(conn, "orders", "billing", ToTime(now + 60_000))
        with pytest.raises(PastTimeToLive) as refused:
            _seek(conn, "orders", "billing", ToTime(now - 1_200_000))
        assert "600000 ms" in str(refused.value)
        assert _seek(conn, "orders", "billing", ToTime(now - 300_000)).epoch == 1
        with pytest.raises(NoSuchChannel):
            _seek(conn, "orders", "nobody", ToLatest())
        with pytest.raises(NoSuchChannel):
            _seek(conn, "nothing", "billing", ToLatest(), dry_run=True)
        with pytest.raises(ValueError):
            ToId(0)


def test_a_seek_waits_for_the_topics_sweep(world, pg_dsn):
    """The seek holds the topic's advisory lock (7361005) exclusively: while a sweep holds
    it shared, the seek waits (here: until its lock timeout), and writes nothing."""
    conn, _ = world
    before = _state(conn, "orders")
    with connect(pg_dsn) as sweeper:
        sweeper.execute("SELECT pg_advisory_xact_lock_shared(7361005, hashtext('orders'))")
        conn.execute("SET lock_timeout = '200ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            _seek(conn, "orders", "billing", ToLatest())
        # another topic's seek does not wait
        registry.create_topic(conn, "clicks")
        registry.add_channel(conn, "clicks", "stats")
        assert _seek(conn, "clicks", "stats", ToLatest()).epoch == 1
        sweeper.rollback()
    assert _state(conn, "orders") == before
    assert _seek(conn, "orders", "billing", ToLatest()).epoch == 1


def _index_fetches(conn: psycopg.Connection) -> int:
    """Rows of dmq_message fetched by any index so far (test_sweep's reading of the statistics)."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    return conn.execute("SELECT coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables WHERE relname = 'dmq_message'"
                        ).fetchone()[0]


def test_a_seek_reads_its_topics_rows_only(pg_dsn):
    """Each incarnation's rows are read from the topic index, also for an incarnation with
    no message of the topic (node-2's, which stored only clicks): a dry run to the latest, and
    a seek to an id near the end, fetch a few rows, where walking the primary key for it
    through orders (most of the table) would fetch all of them."""
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders")
        registry.add_channel(conn, "orders", "billing")
        registry.create_topic(conn, "clicks")
        busy, quiet = _owners(conn, "node-1", "node-2")
        conn.execute(
            "INSERT INTO dmq_message (topic, producer, session_id, node_id, owner, body) "
            "SELECT CASE WHEN mod(g, 10) = 0 THEN 'clicks' ELSE 'orders' END, 'p', g, 'node-1', "
            "CASE WHEN mod(g, 10) = 0 THEN %s ELSE %s END, 'x' FROM generate_series(1, 50000) g", (quiet, busy))
        conn.execute("ANALYZE dmq_message")
        top = conn.execute("SELECT max(id) FROM dmq_message WHERE topic = 'orders'").fetchone()[0]
        before = _index_fetches(conn)
        assert _seek(conn, "orders", "billing", ToLatest(), dry_run=True).count == 0
        assert _seek(conn, "orders", "billing", ToId(top - 49)).count == 45
        fetched = _index_fetches(conn) - before
        assert fetched < 500, fetched
        assert len(_pending(conn, "orders", "billing")) == 45


def test_an_ack_made_durable_after_the_seeks_snapshot_above_its_top_stays(world, pg_dsn):
    """A message stored and acknowledged while a seek runs, above what the seek read: the
    seek's statement took its snapshot before the message committed, then waited for the
    cursor's row, which the ack's transaction held. The seek counted and replays what it
    read; the late message's ack stays (the chaos tier's seek-node-kill saw four such
    messages pushed again after their acks were durable: the cursor was written over)."""
    conn, stored = world
    ordered = sorted(stored.times)
    owner = stored.owners[ordered[-1]]
    with connect(pg_dsn) as sender, connect(pg_dsn) as acker, connect(pg_dsn, autocommit=True) as seeker:
        # the late message: its id drawn and its row written, not committed yet
        (late,) = run_steps(sender, insert_messages_steps([NewMessage("orders", "late", 1, 0, b"x")],
                                                          f"node-{owner}", owner))
        # its ack's transaction, holding the cursor's row
        acker.execute("UPDATE dmq_cursor SET done = done + int8multirange(int8range(%(id)s, %(id)s, '[]')) "
                      "WHERE topic = 'orders' AND channel = 'billing' AND owner = %(owner)s",
                      {"id": late.message_id, "owner": owner})
        pid = seeker.execute("SELECT pg_backend_pid()").fetchone()[0]
        result: dict[str, Sought] = {}

        def seek() -> None:
            result["sought"] = _seek(seeker, "orders", "billing", ToId(ordered[100]))

        thread = threading.Thread(target=seek)
        thread.start()
        # the seek waits for the cursor's row: its snapshot is taken (the late message unseen)
        wait_for(lambda: conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                                      (pid,)).fetchone()[0] == "Lock", timeout=30)
        sender.commit()
        acker.commit()
        thread.join(30)
    sought = result["sought"]
    assert (sought.count, sought.top) == (20, ordered[-1])
    assert _pending(conn, "orders", "billing") == stored.from_id(ordered[100])
    assert _pending(conn, "orders", "audit") == {late.message_id}

"""The resend map's schedule, capacity and failover rules, on numbers alone.

``ResendMap`` reads no clock and does no IO, so these tests pass ``now`` by
hand: the whole 3 x 30 s schedule is checked in microseconds.
"""

from __future__ import annotations

import threading

import pytest

from dmq_client import Message
from dmq_client.pending import PendingSend
from dmq_client.resend import ResendMap


def item(session_id: int) -> PendingSend:
    return PendingSend(Message("orders", b"x"), session_id, "p", 0)


def test_default_schedule_is_three_resends_thirty_seconds_apart():
    """Written at t: resent at t+30, t+60, t+90; OUT_OF_RETRY at t+120, not before."""
    rmap = ResendMap(capacity=10, interval=30.0, tries=3)
    rmap.add(item(1), "a", now=0.0)
    timeline = {}
    for now in [x * 0.5 for x in range(0, 300)]:
        resend, expired = rmap.due(now)
        if resend:
            timeline.setdefault("resend", []).append(now)
        if expired:
            timeline["expired"] = now
            assert expired[0].attempts == 4 and expired[0].resends == 3
    assert timeline == {"resend": [30.0, 60.0, 90.0], "expired": 120.0}
    assert len(rmap) == 0


def test_a_reply_removes_the_entry():
    """pop() takes the entry out; nothing is resent afterwards, a second pop finds nothing."""
    rmap = ResendMap(capacity=10, interval=1.0, tries=3)
    rmap.add(item(1), "a", now=0.0)
    assert rmap.pop(("p", 1)).session_id == 1
    assert rmap.pop(("p", 1)) is None
    assert rmap.due(100.0) == ([], [])


def test_only_due_entries_are_touched_and_order_follows_the_last_write():
    """Entries written at different times come due at their own times."""
    rmap = ResendMap(capacity=10, interval=10.0, tries=1)
    for sid, t in ((1, 0.0), (2, 4.0), (3, 8.0)):
        rmap.add(item(sid), "a", now=t)
    resend, expired = rmap.due(10.0)
    assert [i.session_id for i in resend] == [1] and expired == []
    resend, _ = rmap.due(14.0)
    assert [i.session_id for i in resend] == [2]
    _, expired = rmap.due(20.0)
    assert [i.session_id for i in expired] == [1]


def test_zero_tries_means_out_of_retry_after_one_interval():
    """resend_tries=0: no resend at all, OUT_OF_RETRY one interval after the send."""
    rmap = ResendMap(capacity=10, interval=5.0, tries=0)
    rmap.add(item(1), "a", now=0.0)
    assert rmap.due(4.9) == ([], [])
    resend, expired = rmap.due(5.0)
    assert resend == [] and [i.session_id for i in expired] == [1]


def test_failover_write_gives_a_fresh_interval_without_using_a_try():
    """``rewritten`` (a write to another server after the first failed) restarts the
    interval but leaves the resend budget intact."""
    rmap = ResendMap(capacity=10, interval=10.0, tries=1)
    entry = item(1)
    rmap.add(entry, "a", now=0.0)
    rmap.rewritten(entry, "b", now=8.0)
    assert entry.server == "b" and entry.attempts == 2 and entry.resends == 0
    assert rmap.due(17.9) == ([], [])
    resend, _ = rmap.due(18.0)
    assert resend == [entry] and entry.resends == 1
    assert [i.session_id for i in rmap.due(28.0)[1]] == [1]


def test_same_session_id_twice_is_refused():
    """A second entry with a session id already awaiting a reply is refused, not merged."""
    rmap = ResendMap(capacity=10, interval=1.0, tries=1)
    assert rmap.add(item(1), "a", now=0.0)
    assert not rmap.add(item(1), "a", now=0.0)
    added, refused = rmap.add_many([item(1), item(2)], "a", now=0.0)
    assert [i.session_id for i in refused] == [1] and [i.session_id for i in added] == [2] and len(rmap) == 2


def test_a_resend_of_a_message_in_flight_follows_it_instead_of_being_refused():
    """A resend (a journal replay, ``client.resend``) of a (producer, session id) awaiting
    its reply is the same message: it is neither refused nor written again, but attached
    to the entry as a follower, so whoever pops the entry answers both. The same session
    id under another producer is another message and gets its own entry."""
    rmap = ResendMap(capacity=10, interval=1.0, tries=1)
    leader = item(1)
    assert rmap.add(leader, "a", now=0.0)
    copy = item(1)
    copy.resend = True
    other = PendingSend(Message("orders", b"x"), 1, "q", 0, resend=True)
    added, refused = rmap.add_many([copy, other], "a", now=0.0)
    assert added == [other] and refused == [] and leader.followers == [copy]
    assert copy.attempts == 0 and len(rmap) == 2
    assert rmap.pop(("p", 1)) is leader and rmap.pop(("q", 1)) is other


def test_on_server_lists_the_entries_awaiting_that_server():
    """Failover finds exactly the entries last written to the failed server."""
    rmap = ResendMap(capacity=10, interval=1.0, tries=1)
    rmap.add_many([item(1), item(2)], "a", now=0.0)
    rmap.add(item(3), "b", now=0.0)
    assert sorted(i.session_id for i in rmap.on_server("a")) == [1, 2]


def test_capacity_makes_the_writer_wait_until_a_reply_frees_room():
    """wait_for_room blocks at capacity and is released by a reply (pop)."""
    rmap = ResendMap(capacity=2, interval=1.0, tries=1)
    rmap.add_many([item(1), item(2)], "a", now=0.0)
    assert not rmap.wait_for_room(1, timeout=0)
    released = threading.Event()

    def writer() -> None:
        if rmap.wait_for_room(1, timeout=10):
            released.set()

    thread = threading.Thread(target=writer)
    thread.start()
    assert not released.is_set()
    rmap.pop(("p", 1))
    assert released.wait(10)
    thread.join(10)


@pytest.mark.parametrize("n, room", [(1, True), (2, False), (5, False)])
def test_wait_for_room_for_a_batch(n, room):
    """A batch of n waits until n entries fit (a batch larger than the capacity waits for an
    empty map rather than forever)."""
    rmap = ResendMap(capacity=3, interval=1.0, tries=1)
    rmap.add_many([item(1), item(2)], "a", now=0.0)
    assert rmap.wait_for_room(n, timeout=0) is room


def test_drain_empties_the_map_and_wakes_waiters():
    """Closing drains every entry and frees room for a waiting writer."""
    rmap = ResendMap(capacity=1, interval=1.0, tries=1)
    rmap.add(item(1), "a", now=0.0)
    assert [i.session_id for i in rmap.drain()] == [1]
    assert len(rmap) == 0 and rmap.wait_for_room(1, timeout=0)


def test_settle_lets_exactly_one_path_report():
    """Of several threads racing to report one send, exactly one wins."""
    entry = item(1)
    wins = []
    barrier = threading.Barrier(8)

    def racer() -> None:
        barrier.wait()
        if entry.settle():
            wins.append(1)

    threads = [threading.Thread(target=racer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert wins == [1]


def test_memory_per_entry_is_small_and_stated():
    """An in-flight send costs its body plus under 520 bytes (PendingSend, Message,
    SendFuture, ids, its (producer, session id) key, map slot): the figure docs/client.md
    states for the resend map."""
    import tracemalloc

    rmap = ResendMap(capacity=20000, interval=30.0, tries=3)
    body = b"x" * 100
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(10000):
            rmap.add(PendingSend(Message("orders", body), 10**15 + i, "producer", 1), "a", now=0.0)
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert used / 10000 < 520, used / 10000

"""The producer journal (``dmq_client.journal``): durability, what counts as finished, recovery.

A crash is simulated in-process with ``JournalSendQueue.abandon()``: it closes the
files without syncing anything, which leaves them as a ``kill -9`` of the process
would (what was written is in the page cache, nothing buffered in memory is). The
real ``kill -9`` of a producer process against a real server is in
``tests/integration/test_client_journal.py``.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from dmq_client import Message, MqClient, MqConfig, SendResult, Status
from dmq_client.diskqueue import DiskQueue, DiskQueueError
from dmq_client.journal import JournalError, JournalSendQueue, decode_record, encode_record
from dmq_client.pending import PendingSend
from dmq_client.send_queue import Put
from dmq_client.wire import Command, Frame, MessageType
from dmq_sql.ports import fresh_port

from .test_client_fake_server import WAIT, FakeClock, FakeServer, config, never_answer, success


def item(n: int, topic: str = "orders", producer: str = "p1") -> PendingSend:
    return PendingSend(Message(topic, f"body {n}"), 1000 + n, producer, 1_700_000_000_000 + n)


def finish(queue: JournalSendQueue, it: PendingSend, status: Status = Status.SUCCESS) -> None:
    """What the client does after delivering a result: set it, then task_done."""
    it.result = SendResult(status, it.message, it.session_id)
    queue.task_done(it)


def journal(path, **kwargs) -> JournalSendQueue:
    kwargs.setdefault("ticker", False)
    return JournalSendQueue(path, **kwargs)


def sids(items) -> list[int]:
    return [i.session_id for i in items]


# -- records ------------------------------------------------------------------------------------


def test_record_keeps_everything_needed_to_resend_and_detects_damage():
    """A record round-trips producer, session id, topic, type, due time, timestamp and body;
    a flipped byte fails its checksum."""
    it = PendingSend(Message.delayed("orders", b"\x00later", due=1_900_000_000.25, session_id=77),
                     77, "billing-1", 1_700_000_000_123, resend=True)
    data = encode_record(5, it)
    rec = decode_record(data)
    assert (rec.seq, rec.session_id, rec.producer, rec.topic, rec.body) == (5, 77, "billing-1", "orders", b"\x00later")
    assert (rec.msg_type, rec.due_ms, rec.timestamp_ms, rec.resend) == (MessageType.DELAY, 1_900_000_000_250,
                                                                        1_700_000_000_123, True)
    damaged = bytearray(data)
    damaged[-1] ^= 1
    with pytest.raises(ValueError, match="checksum"):
        decode_record(bytes(damaged))
    with pytest.raises(ValueError):
        decode_record(data[:10])


# -- durability and recovery ---------------------------------------------------------------------


def test_accepted_messages_survive_a_crash_and_come_back_as_resends(tmp_path):
    """With sync_every=1 every put is synced before it returns; after a crash the next open
    hands back every message, in order, with its producer, session id and timestamp, marked
    as a resend (UP_PRODUCER_RESEND), counted in ``recovered``."""
    q = journal(tmp_path)
    items = [item(n) for n in range(5)]
    assert [q.put(i) for i in items] == [Put.ACCEPTED] * 5
    assert q.syncs == 5
    q.get_batch(3, timeout=0)  # taken by the send runner: still journaled
    q.abandon()

    q2 = journal(tmp_path)
    try:
        assert q2.recovered == 5 and len(q2) == 5 and q2.journaled == 5
        again = q2.get_batch(10, timeout=0)
        assert sids(again) == sids(items)
        first = again[0]
        assert (first.producer, first.timestamp_ms, first.message.body, first.resend) == (
            "p1", items[0].timestamp_ms, b"body 0", True)
        assert first.message.session_id == first.session_id == 1000
    finally:
        q2.shutdown()


def test_finished_messages_are_not_replayed_whatever_order_they_finish_in(tmp_path):
    """Results arrive out of order: the head finishing moves the watermark, a later one
    goes to done.log. After a synced crash only the unfinished ones come back, in order."""
    q = journal(tmp_path)
    items = [item(n) for n in range(6)]
    for i in items:
        q.put(i)
    q.get_batch(10, timeout=0)
    finish(q, items[2])
    finish(q, items[4])
    finish(q, items[0])  # the head: read off at once
    finish(q, items[1])  # now 1 and 2 are read off too
    assert q.journaled == 2
    q.sync()
    q.abandon()

    q2 = journal(tmp_path)
    try:
        assert sids(q2.get_batch(10, timeout=0)) == [1003, 1005]
    finally:
        q2.shutdown()


def test_a_finish_not_yet_synced_is_replayed_at_least_once(tmp_path):
    """A finish is made durable by the next sync, not at once: a crash before it replays
    the message (the server answers the resend as a duplicate)."""
    q = journal(tmp_path)
    a, b = item(1), item(2)
    q.put(a)
    q.put(b)
    finish(q, b)  # out of order: only in memory until the next sync
    q.abandon()
    q2 = journal(tmp_path)
    try:
        assert sids(q2.get_batch(10, timeout=0)) == [1001, 1002]
    finally:
        q2.shutdown()


@pytest.mark.parametrize("status, kept", [
    (Status.SUCCESS, False),
    (Status.NO_TOPIC, False),
    (Status.INVALID_MESSAGE, False),
    (Status.SOCKET_ERROR, True),
    (Status.SERVER_ERROR, True),
    (Status.RATE_LIMIT_EXCEEDED, True),
    (Status.OUT_OF_RETRY, True),
    (Status.CLIENT_CLOSED, True),
])
def test_only_a_final_result_removes_a_message(tmp_path, status, kept):
    """A message leaves the journal only once it was stored (SUCCESS) or refused for good
    (NO_TOPIC, INVALID_MESSAGE: the application's to fix). A transient failure or
    CLIENT_CLOSED keeps it for the next open: it may never have reached a server. (Before
    issue 13 every result but CLIENT_CLOSED removed it: SOCKET_ERROR lost the message.)"""
    q = journal(tmp_path)
    it = item(0)
    q.put(it)
    q.get_batch(10, timeout=0)
    finish(q, it, status)
    assert q.journaled == (1 if kept else 0)
    q.shutdown()
    q2 = journal(tmp_path)
    try:
        assert sids(q2.get_batch(10, timeout=0)) == ([1000] if kept else [])
    finally:
        q2.shutdown()


def test_a_transient_failure_the_producer_gave_up_on_removes_the_message(tmp_path):
    """``given_up`` (set when ``journal_give_up_after`` ran out) is the application's
    explicit choice: that failure removes the message."""
    q = journal(tmp_path)
    it = item(0)
    q.put(it)
    q.get_batch(10, timeout=0)
    it.given_up = True
    finish(q, it, Status.SOCKET_ERROR)
    assert q.journaled == 0
    q.shutdown()
    with journal(tmp_path) as q2:
        assert q2.recovered == 0


def test_recovery_keeps_one_copy_per_producer_and_session_id(tmp_path):
    """A message and its own resend copy (``client.resend`` journals a second record with
    the same producer and session id) both unfinished at a crash: the next open sends the
    message once, under its first record, so the second copy cannot be refused as
    "already awaiting a reply". The same session id under another producer is another
    message and is kept. (Before issue 13 recovery deduplicated by record only.)"""
    q = journal(tmp_path)
    first = item(1)
    copy = PendingSend(Message("orders", "body 1"), 1001, "p1", first.timestamp_ms + 5, resend=True)
    other = item(1, producer="p2")
    later = item(2)
    for it in (first, copy, other, later):
        assert q.put(it) is Put.ACCEPTED
    q.abandon()
    q2 = journal(tmp_path)
    try:
        assert q2.recovered == 3 and q2.duplicates == 1
        again = q2.get_batch(10, timeout=0)
        assert [(i.producer, i.session_id, i.timestamp_ms) for i in again] == [
            ("p1", 1001, first.timestamp_ms), ("p2", 1001, other.timestamp_ms), ("p1", 1002, later.timestamp_ms)]
        for i in again:
            finish(q2, i)
        assert q2.journaled == 0
    finally:
        q2.shutdown()
    with journal(tmp_path) as q3:  # the dropped copy is not resurrected either
        assert q3.recovered == 0


def test_held_items_count_against_the_capacity_until_requeued(tmp_path):
    """Items the producer holds for a retry still occupy the queue's bound, so memory stays
    bounded while a server is away; ``requeue`` puts them back ahead of new sends; an item
    the journal never accepted cannot be held (it gets its failure instead)."""
    q = journal(tmp_path, capacity=2)
    a, b, c = item(1), item(2), item(3)
    q.put(a)
    q.put(b)
    assert q.get_batch(10, timeout=0) == [a, b]
    assert q.hold(a) and q.hold(b)
    assert q.put(c) is Put.FULL and not q.hold(c)
    q.requeue([a])
    assert q.get_batch(10, timeout=0) == [a]
    q.unhold(1)
    assert q.put(c) is Put.ACCEPTED
    q.shutdown()


def test_clean_shutdown_with_everything_finished_leaves_nothing_to_replay(tmp_path):
    """All finished, then shutdown: the next open recovers nothing, and the directory holds
    one (empty) generation and an empty done.log."""
    q = journal(tmp_path)
    items = [item(n) for n in range(4)]
    for i in items:
        q.put(i)
    for i in reversed(items):
        finish(q, i)
    q.shutdown()
    q2 = journal(tmp_path)
    q2.shutdown()
    assert q2.recovered == 0
    names = sorted(os.listdir(tmp_path))
    assert names == ["done.log", "journal-1.diskqueue.meta.dat", "lock"], names
    assert os.path.getsize(tmp_path / "done.log") == 0


def test_recovery_spans_data_files_and_frees_finished_ones(tmp_path):
    """With small data files the journal rotates; files whose records all finished are
    deleted while running, and recovery reads the rest across files, in order."""
    q = journal(tmp_path, file_bytes=300)
    items = [item(n) for n in range(40)]
    for i in items:
        q.put(i)
    files_before = len([n for n in os.listdir(tmp_path) if n.endswith(".dat") and "meta" not in n])
    for i in items[:25]:
        finish(q, i)
    q.sync()
    files_after = len([n for n in os.listdir(tmp_path) if n.endswith(".dat") and "meta" not in n])
    assert files_after < files_before
    q.abandon()
    q2 = journal(tmp_path, file_bytes=300)
    try:
        assert sids(q2.get_batch(100, timeout=0)) == sids(items[25:])
    finally:
        q2.shutdown()


def test_an_interrupted_recovery_loses_and_duplicates_nothing(tmp_path):
    """A crash while opening (the new generation partly written, the old one still there)
    is merged by sequence number on the next open: each message once, in order."""
    q = journal(tmp_path)
    items = [item(n) for n in range(4)]
    for i in items:
        q.put(i)
    q.abandon()  # generation 0 holds seqs 0..3
    partial = DiskQueue("journal-1", tmp_path, max_msg_size=64 * 1024 * 1024)
    partial.put(encode_record(0, items[0]))  # what a crashed open had copied so far
    partial.put(encode_record(1, items[1]))
    partial.close()
    q2 = journal(tmp_path)
    try:
        assert q2.recovered == 4
        assert sids(q2.get_batch(10, timeout=0)) == sids(items)
        assert not any(n.startswith(("journal-0.", "journal-1.")) for n in os.listdir(tmp_path))
    finally:
        q2.shutdown()


def test_a_damaged_record_is_skipped_and_the_rest_recovered(tmp_path):
    """A record whose checksum fails is logged, counted and skipped; its neighbours survive."""
    q = journal(tmp_path)
    q.put(item(1))
    q.abandon()
    dq = DiskQueue("journal-0", tmp_path, max_msg_size=64 * 1024 * 1024)
    bad = bytearray(encode_record(1, item(2)))
    bad[20] ^= 0xFF
    dq.put(bytes(bad))
    dq.put(encode_record(2, item(3)))
    dq.close()
    q2 = journal(tmp_path)
    try:
        assert q2.bad_records == 1
        assert sids(q2.get_batch(10, timeout=0)) == [1001, 1003]
    finally:
        q2.shutdown()


def test_done_log_is_compacted_and_stays_correct(tmp_path):
    """An old message that never finishes keeps the watermark still, so later finishes go
    to done.log; it is rewritten with only what is still needed, and a crash after that
    replays exactly the unfinished messages."""
    q = journal(tmp_path, sync_every=1000)
    q.compact_after = 8
    stuck = item(0)
    q.put(stuck)
    items = [item(n) for n in range(1, 41)]
    for i in items:
        q.put(i)
        finish(q, i)
        q.sync()
    assert os.path.getsize(tmp_path / "done.log") <= 8 * 40
    last = item(99)
    q.put(last)
    q.sync()
    q.abandon()
    q2 = journal(tmp_path)
    try:
        assert sids(q2.get_batch(100, timeout=0)) == [1000, 1099]
    finally:
        q2.shutdown()


def test_done_log_compaction_drops_entries_of_messages_read_off(tmp_path):
    """Once the stuck head finishes, everything is read off; done.log shrinks at the next
    compaction and nothing is replayed."""
    q = journal(tmp_path, sync_every=1000)
    q.compact_after = 4
    items = [item(n) for n in range(12)]
    for i in items:
        q.put(i)
    for i in items[1:]:
        finish(q, i)
    q.sync()
    assert os.path.getsize(tmp_path / "done.log") == 8 * 11
    finish(q, items[0])
    assert q.journaled == 0
    q.put(item(50))
    finish(q, item(50))  # never journaled (another object): ignored
    q.sync()
    assert os.path.getsize(tmp_path / "done.log") == 0
    q.abandon()
    q2 = journal(tmp_path)
    try:
        assert sids(q2.get_batch(100, timeout=0)) == [1050]
    finally:
        q2.shutdown()


# -- sync policy ------------------------------------------------------------------------------------


def test_sync_every_n_syncs_the_nth_put_and_the_ticker_the_rest(tmp_path):
    """sync_every=3: the 3rd and 6th puts sync; the 7th waits for ``sync_pending`` (the
    ticker's call every sync_interval); an idle journal does not sync."""
    q = journal(tmp_path, sync_every=3)
    try:
        counts = []
        for n in range(7):
            q.put(item(n))
            counts.append(q.syncs)
        assert counts == [0, 0, 1, 1, 1, 2, 2]
        q.sync_pending()
        assert q.syncs == 3
        q.sync_pending()
        assert q.syncs == 3
    finally:
        q.shutdown()


def test_the_ticker_thread_syncs_within_the_interval(tmp_path):
    """With the ticker on, an unsynced put becomes durable without another put: the
    ticker's sync is observed through an event, waited for with a deadline."""
    synced = threading.Event()

    class Observed(JournalSendQueue):
        def sync_pending(self) -> None:
            super().sync_pending()
            if self.syncs:
                synced.set()

    q = Observed(tmp_path, sync_every=100, sync_interval=0.05)
    try:
        q.put(item(1))
        assert q.syncs == 0
        assert synced.wait(WAIT)
    finally:
        q.shutdown()


def test_concurrent_senders_are_each_durable_when_put_returns(tmp_path):
    """8 threads putting at once (they share fsyncs when they overlap: at most one sync
    per put): every put that returned is recovered after a crash."""
    q = journal(tmp_path)
    barrier = threading.Barrier(8)
    made: list[PendingSend] = []
    lock = threading.Lock()

    def sender(t: int) -> None:
        barrier.wait()
        for n in range(25):
            it = item(t * 100 + n)
            assert q.put(it) is Put.ACCEPTED
            with lock:
                made.append(it)

    threads = [threading.Thread(target=sender, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(made) == 200 and q.syncs <= 200
    q.abandon()
    q2 = journal(tmp_path)
    try:
        assert sorted(sids(q2.get_batch(1000, timeout=0))) == sorted(sids(made))
    finally:
        q2.shutdown()


# -- the SendQueue contract ---------------------------------------------------------------------


def test_bounded_put_closed_and_refused_items(tmp_path):
    """FULL at capacity (queued items only), CLOSED after close, and task_done of an item
    that was refused is ignored."""
    q = journal(tmp_path, capacity=2)
    try:
        a, b, c = item(1), item(2), item(3)
        assert [q.put(a), q.put(b), q.put(c)] == [Put.ACCEPTED, Put.ACCEPTED, Put.FULL]
        finish(q, c)  # refused: not journaled
        assert q.journaled == 2
        q.get_batch(1, timeout=0)
        assert q.put(c) is Put.ACCEPTED
        q.close()
        assert q.put(item(4)) is Put.CLOSED
        assert sids(q.drain()) == [1002, 1003] and q.get_batch(5, timeout=None) == []
    finally:
        q.shutdown()


def test_a_failed_journal_write_is_refused_not_accepted(tmp_path):
    """If the journal cannot write the record, put answers FAILED (the client reports
    QUEUE_FULL with an E_JOURNAL description): an accepted message is always journaled."""
    q = journal(tmp_path)
    try:
        def broken(data: bytes) -> None:
            raise DiskQueueError("write failed: [Errno 28] No space left on device")

        q._dq.put = broken
        assert q.put(item(1)) is Put.FAILED
        assert q.last_error.startswith("E_JOURNAL") and "No space" in q.last_error
        assert q.journaled == 0 and len(q) == 0
    finally:
        q.shutdown()


def test_each_open_sends_new_messages_under_a_new_producer_id(tmp_path):
    """Without a configured id every open gets a new producer id (a producer instance is
    one open), while recovered messages keep the id they were first sent with; a
    configured id is used as given."""
    q = journal(tmp_path)
    first = q.producer_id
    q.put(item(1, producer=first))
    q.abandon()
    q = journal(tmp_path)
    assert q.producer_id != first and first.startswith("py-")
    assert [i.producer for i in q.get_batch(10, timeout=0)] == [first]
    q.shutdown()
    q = journal(tmp_path, producer_id="billing-api-3")
    assert q.producer_id == "billing-api-3"
    q.shutdown()


def test_one_journal_one_client(tmp_path):
    """A second open of a journal in use fails with JournalError; after shutdown it opens."""
    q = journal(tmp_path)
    with pytest.raises(JournalError, match="in use"):
        journal(tmp_path)
    q.shutdown()
    journal(tmp_path).shutdown()


@pytest.mark.parametrize(
    "field, value",
    [("journal_path", ""), ("journal_path", 5), ("journal_sync_every", 0),
     ("journal_sync_interval", 0), ("recovered_callback", "not callable")],
)
def test_bad_journal_settings_fail_at_construction(field, value):
    """The journal settings are validated like the others, naming the field."""
    with pytest.raises(ValueError, match=field):
        MqConfig(**{field: value})


# -- through MqClient -------------------------------------------------------------------------------


def test_client_replays_recovered_messages_to_recovered_callback(tmp_path):
    """A client opening a journal with unfinished messages sends them first, as
    UP_PRODUCER_RESEND with the original producer and session ids; their results go to
    ``recovered_callback``; its own new sends go under its own new producer id."""
    q = journal(tmp_path, producer_id="orders-api-1")
    for n in range(3):
        q.put(item(n, producer="orders-api-1"))
    q.abandon()

    server = FakeServer()
    got: list[SendResult] = []
    all_in = threading.Event()

    def recovered(result: SendResult) -> None:
        got.append(result)
        if len(got) == 3:
            all_in.set()

    try:
        cfg = config(server, journal_path=str(tmp_path), recovered_callback=recovered)
        with MqClient(cfg) as client:
            assert client.producer_id != "orders-api-1"
            assert all_in.wait(WAIT)
            assert client.flush(WAIT)
            fresh = client.send(Message("orders", b"new")).result(WAIT)
        frames = [server.next(Command.UP_PRODUCER_RESEND)[1] for _ in range(3)]
        assert [(f.producer, f.session_id, f.body) for f in frames] == [
            ("orders-api-1", 1000 + n, f"body {n}".encode()) for n in range(3)]
        assert sorted(r.session_id for r in got) == [1000, 1001, 1002] and all(r.ok for r in got)
        assert fresh.ok
        assert server.next(Command.UP_PRODUCER_SEND)[1].producer == client.producer_id
        assert all(r.producer == "orders-api-1" for r in got)  # client.resend(r) would use it
    finally:
        server.close()
    q = journal(tmp_path)
    assert q.recovered == 0
    q.shutdown()


def test_client_close_keeps_unanswered_messages_for_the_next_client(tmp_path):
    """Closing while the server does not answer reports CLIENT_CLOSED, says the message is
    kept, and the next client with the journal sends it again."""
    server = FakeServer(reply=never_answer)
    try:
        with MqClient(config(server, journal_path=str(tmp_path), resend_interval=60)) as client:
            future = client.send(Message("orders", b"pending"))
            server.next(Command.UP_PRODUCER_SEND)
            client.close(timeout=0)
        result = future.result(WAIT)
        assert result.status is Status.CLIENT_CLOSED and "kept in the producer journal" in result.description
    finally:
        server.close()
    q = journal(tmp_path)
    try:
        again = q.get_batch(10, timeout=0)
        assert [(i.session_id, i.message.body) for i in again] == [(result.session_id, b"pending")]
    finally:
        q.shutdown()


def test_client_reports_a_failed_journal_write_as_queue_full(tmp_path):
    """A journal write failure reaches the caller at once as QUEUE_FULL with E_JOURNAL."""
    server = FakeServer()
    try:
        with MqClient(config(server, journal_path=str(tmp_path))) as client:
            def broken(data: bytes) -> None:
                raise DiskQueueError("write failed: [Errno 5] Input/output error")

            client._producer.queue._dq.put = broken
            result = client.send(Message("orders", b"x")).result(WAIT)
        assert result.status is Status.QUEUE_FULL and result.description.startswith("E_JOURNAL")
    finally:
        server.close()


# -- transient failures of journaled sends are retried, not dropped -------------------------------


def until(predicate, what: str, timeout: float = WAIT) -> None:
    """Wait for a state another thread reaches (a deadline, not a guess at how long it takes)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def storage_errors(n: int):
    """A reply script: E_STORAGE for the first ``n`` sends or resends, then SUCCESS."""
    seen = []

    def reply(frame: Frame) -> list[Frame]:
        if frame.command not in (Command.UP_PRODUCER_SEND, Command.UP_PRODUCER_RESEND):
            return never_answer(frame)
        seen.append(frame)
        if len(seen) <= n:
            return [Frame(Command.SEND_SERVER_ERROR, session_id=frame.session_id, topic=frame.topic,
                          producer=frame.producer, status="E_STORAGE database down")]
        return success(frame, 900 + len(seen))

    return reply


def test_no_server_within_route_wait_keeps_the_message_and_retries_it_until_stored(tmp_path):
    """Issue 13, item 5: no server within ``route_wait`` used to be a SOCKET_ERROR that
    removed the message from the journal. Now the send stays journaled and pending, is
    tried again after a backoff (1 s, then 2 s, on the injected clock) as often as it
    takes, and is stored once a server is there; its one result is that SUCCESS."""
    port = fresh_port()  # nothing listens here yet
    clock = FakeClock()
    cfg = MqConfig(servers=(f"127.0.0.1:{port}",), journal_path=str(tmp_path), route_wait=0.0,
                   resend_check_interval=3600, reconnect_backoff=0.01, reconnect_backoff_max=0.05,
                   connect_timeout=2.0, journal_retry_backoff=1.0, journal_retry_backoff_max=2.0)
    client = MqClient(cfg, clock=clock)
    producer = client._producer
    server = None
    try:
        future = client.send(Message("orders", b"kept"))
        until(lambda: producer.retried == 1 and producer.retrying == 1, "the first retry to be scheduled")
        assert not future.done() and producer.queue.journaled == 1
        clock.advance(0.9)
        assert producer.release_retries(clock()) == 0  # not due yet
        clock.advance(0.1)
        assert producer.release_retries(clock()) == 1
        until(lambda: producer.retried == 2 and producer.retrying == 1, "the second failure")
        assert not future.done() and producer.queue.journaled == 1

        server = FakeServer(port=port)
        assert client.wait_connected(WAIT)
        clock.advance(2.0)  # the backoff doubled
        producer.check_resends()
        result = future.result(WAIT)
        assert result.status is Status.SUCCESS and result.message_id == 7
        _, frame = server.next(Command.UP_PRODUCER_RESEND)
        assert (frame.producer, frame.session_id, frame.body) == (client.producer_id, result.session_id, b"kept")
        assert producer.queue.journaled == 0
    finally:
        client.close(timeout=0)
        if server is not None:
            server.close()
    with journal(tmp_path) as reopened:
        assert reopened.recovered == 0


def test_storage_errors_are_retried_with_backoff_under_the_same_identity(tmp_path):
    """SEND_SERVER_ERROR (E_STORAGE) twice, then the server stores it: the caller sees one
    SUCCESS; the tries were resends of the same (producer, session id), each after its
    backoff on the injected clock."""
    server = FakeServer(reply=storage_errors(2))
    clock = FakeClock()
    try:
        cfg = config(server, journal_path=str(tmp_path), resend_check_interval=3600)
        with MqClient(cfg, clock=clock) as client:
            producer = client._producer
            future = client.send(Message("orders", b"x"))
            _, first = server.next(Command.UP_PRODUCER_SEND)
            until(lambda: producer.retrying == 1, "the first retry")
            clock.advance(1.0)
            producer.check_resends()
            _, second = server.next(Command.UP_PRODUCER_RESEND)
            until(lambda: producer.retrying == 1 and producer.retried == 2, "the second retry")
            clock.advance(1.9)
            producer.check_resends()
            assert server.received.empty() and not future.done()  # 2 s backoff now
            clock.advance(0.1)
            producer.check_resends()
            result = future.result(WAIT)
            _, third = server.next(Command.UP_PRODUCER_RESEND)
        assert result.ok and result.message_id == 903 and result.producer == client.producer_id
        assert {(f.producer, f.session_id) for f in (first, second, third)} == {(client.producer_id, result.session_id)}
    finally:
        server.close()
    with journal(tmp_path) as reopened:
        assert reopened.recovered == 0


def test_journal_give_up_after_reports_the_failure_and_forgets_the_message(tmp_path):
    """``journal_give_up_after`` is the application's explicit choice to give up: once a
    send has failed that long its last failure is delivered and the journal forgets it."""
    server = FakeServer(reply=storage_errors(10**9))
    clock = FakeClock()
    try:
        cfg = config(server, journal_path=str(tmp_path), resend_check_interval=3600, journal_give_up_after=1.5)
        with MqClient(cfg, clock=clock) as client:
            producer = client._producer
            future = client.send(Message("orders", b"x"))
            until(lambda: producer.retrying == 1, "the first retry")
            clock.advance(1.0)
            producer.check_resends()
            until(lambda: producer.retried == 2, "the second retry")  # failed 1 s after the first
            assert not future.done()
            clock.advance(2.0)
            producer.check_resends()
            result = future.result(WAIT)  # failed 3 s after the first: given up
            assert result.status is Status.SERVER_ERROR and result.description.startswith("E_STORAGE")
            assert producer.queue.journaled == 0
    finally:
        server.close()
    with journal(tmp_path) as reopened:
        assert reopened.recovered == 0


def test_close_while_retrying_keeps_the_message_for_the_next_client(tmp_path):
    """A send waiting for its retry when the client closes is reported CLIENT_CLOSED, kept
    in the journal, and sent by the next client (under its first producer id)."""
    server = FakeServer(reply=storage_errors(1))
    try:
        cfg = config(server, journal_path=str(tmp_path), resend_check_interval=3600)
        client = MqClient(cfg, clock=FakeClock())
        future = client.send(Message("orders", b"x"))
        until(lambda: client._producer.retrying == 1, "the retry")
        client.close(timeout=0)
        closed = future.result(WAIT)
        assert closed.status is Status.CLIENT_CLOSED and "kept in the producer journal" in closed.description
        replayed: list[SendResult] = []
        with MqClient(config(server, journal_path=str(tmp_path), recovered_callback=replayed.append)) as again:
            assert again.flush(WAIT)
        assert [(r.status, r.session_id, r.producer) for r in replayed] == [
            (Status.SUCCESS, closed.session_id, client.producer_id)]
    finally:
        server.close()


def test_a_replayed_message_and_its_resend_copy_get_one_real_result(tmp_path):
    """After a crash the journal held a message and its own resend copy (its finish mark
    not synced): the next client sends it once and reports the server's answer, not a
    false INVALID_MESSAGE "already awaiting a reply" for the copy (issue 13, item 5)."""
    q = journal(tmp_path, producer_id="orders-api-1")
    first = item(1, producer="orders-api-1")
    q.put(first)
    q.put(PendingSend(Message("orders", "body 1"), 1001, "orders-api-1", first.timestamp_ms, resend=True))
    q.abandon()
    server = FakeServer()
    replayed: list[SendResult] = []
    try:
        with MqClient(config(server, journal_path=str(tmp_path), recovered_callback=replayed.append)) as client:
            assert client.flush(WAIT)
        _, frame = server.next(Command.UP_PRODUCER_RESEND)
        assert (frame.producer, frame.session_id) == ("orders-api-1", 1001)
        assert server.received.empty()
    finally:
        server.close()
    assert [(r.status, r.session_id) for r in replayed] == [(Status.SUCCESS, 1001)]


def test_a_send_waiting_for_its_retry_is_still_stored_during_close(tmp_path):
    """close(timeout) gives pending sends the timeout to be stored; that includes a
    journaled send waiting in the retry pen (the send runner keeps going for it), so it
    ends SUCCESS, not CLIENT_CLOSED."""
    server = FakeServer(reply=storage_errors(1))
    try:
        cfg = config(server, journal_path=str(tmp_path), resend_check_interval=0.01, journal_retry_backoff=0.05)
        client = MqClient(cfg)
        future = client.send(Message("orders", b"x"))
        until(lambda: client._producer.retried == 1, "the retry")
        client.close(timeout=WAIT)
        result = future.result(WAIT)
        assert result.status is Status.SUCCESS and result.message_id == 902
    finally:
        server.close()
    with journal(tmp_path) as reopened:
        assert reopened.recovered == 0

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

import pytest

from dmq_client import Message, MqClient, MqConfig, SendResult, Status
from dmq_client.diskqueue import DiskQueue, DiskQueueError
from dmq_client.journal import JournalError, JournalSendQueue, decode_record, encode_record
from dmq_client.pending import PendingSend
from dmq_client.send_queue import Put
from dmq_client.wire import Command, MessageType

from .test_client_fake_server import WAIT, FakeServer, config, never_answer


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


def test_client_closed_keeps_the_message_every_other_result_removes_it(tmp_path):
    """CLIENT_CLOSED means the producer went away before an answer: the message stays for
    the next open. SOCKET_ERROR, OUT_OF_RETRY, a server's refusal are final: it goes."""
    q = journal(tmp_path)
    items = [item(n) for n in range(5)]
    for i in items:
        q.put(i)
    q.get_batch(10, timeout=0)
    finish(q, items[0], Status.CLIENT_CLOSED)
    finish(q, items[1], Status.SOCKET_ERROR)
    finish(q, items[2], Status.OUT_OF_RETRY)
    finish(q, items[3], Status.NO_TOPIC)
    finish(q, items[4], Status.CLIENT_CLOSED)
    q.shutdown()
    q2 = journal(tmp_path)
    try:
        assert sids(q2.get_batch(10, timeout=0)) == [1000, 1004]
    finally:
        q2.shutdown()


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
    assert names == ["done.log", "journal-1.diskqueue.meta.dat", "lock", "producer_id"], names
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


def test_producer_id_is_kept_in_the_journal(tmp_path):
    """Without a configured id the first open stores one and later opens reuse it; a
    configured id wins and is stored for the next open."""
    q = journal(tmp_path)
    first = q.producer_id
    q.shutdown()
    q = journal(tmp_path)
    assert q.producer_id == first
    q.shutdown()
    q = journal(tmp_path, producer_id="billing-api-3")
    assert q.producer_id == "billing-api-3"
    q.shutdown()
    q = journal(tmp_path)
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
    ``recovered_callback``; the journaled producer id is the client's."""
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
            assert client.producer_id == "orders-api-1"
            assert all_in.wait(WAIT)
            assert client.flush(WAIT)
            fresh = client.send(Message("orders", b"new")).result(WAIT)
        frames = [server.next(Command.UP_PRODUCER_RESEND)[1] for _ in range(3)]
        assert [(f.producer, f.session_id, f.body) for f in frames] == [
            ("orders-api-1", 1000 + n, f"body {n}".encode()) for n in range(3)]
        assert sorted(r.session_id for r in got) == [1000, 1001, 1002] and all(r.ok for r in got)
        assert fresh.ok
        assert server.next(Command.UP_PRODUCER_SEND)[1].producer == "orders-api-1"
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

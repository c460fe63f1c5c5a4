"""The asyncio client's sends (``dmq_client.aio.sends``) over fake links, with an injected
clock: resends on time and OUT_OF_RETRY after the tries, failover at once without using up
a try, the in-flight bound, and the two kinds of cancellation; with the producer journal (a
real one in the test's directory): written only once on disk, transient failures retried,
cancellation and close, recovered records. No sockets; each test runs its coroutine with
``asyncio.run``."""

from __future__ import annotations

import asyncio

from dmq_client import ConsumeStatus, Message, MqConfig, Status
from dmq_client.aio.link import LinkState
from dmq_client.aio.sends import Sends
from dmq_client.confirm import GRACE
from dmq_client.journal import KEPT, JournalSendQueue
from dmq_client.pending import PendingSend
from dmq_client.wire import SERVER_FEATURES, Command, Frame, FrameDecoder
from dmq_client.wire.confirm import CONSUMED, consumed_status


class FakeLink:
    """What ``Sends`` uses of a ``ServerLink``: its name, state, writes and drain."""

    def __init__(self, name: str):
        self.name = name
        self.state = LinkState.READY
        self.written: list[Frame] = []
        self._decoder = FrameDecoder()
        self.sends: Sends
        self.features = frozenset(SERVER_FEATURES.split())

    def write(self, data: bytes) -> bool:
        if self.state is LinkState.DOWN:
            return False
        self.written += self._decoder.feed(data)
        return True

    async def drain(self) -> None:
        pass

    def mark_rebooting(self) -> None:
        self.state = LinkState.REBOOTING
        self.sends.link_leaving(self)  # as ServerLink does, through the client

    def mark_unhealthy(self, detail: str) -> None:
        self.state = LinkState.UNHEALTHY


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(*names: str, on_cancelled=None, **settings):
    config = MqConfig(servers=",".join(f"{n}:1" for n in names), resend_interval=1.0, resend_tries=2, **settings)
    links = {f"{n}:1": FakeLink(f"{n}:1") for n in names}
    clock = Clock()
    sends = Sends(config, "p-1", links, on_cancelled, clock=clock)  # type: ignore[arg-type]
    for link in links.values():
        link.sends = sends
    return sends, links, clock


async def turn() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def answer(link: FakeLink, frame: Frame, message_id: int = 77, status: str = "") -> Frame:
    return Frame(Command.SEND_SUCCESS_ACK, session_id=frame.session_id, message_id=message_id, topic=frame.topic,
                 producer=frame.producer, status=status)


def test_an_unanswered_send_is_resent_on_time_then_out_of_retry():
    """Written once, resent after each ``resend_interval`` as UP_PRODUCER_RESEND under the
    same session id, and OUT_OF_RETRY one interval after the last of ``resend_tries``."""

    async def run():
        sends, links, clock = make("a")
        (link,) = links.values()
        task = asyncio.ensure_future(sends.send(Message("orders", b"x")))
        await turn()
        clock.now += 0.9
        sends.check_resends(clock.now)
        assert [f.command for f in link.written] == [Command.UP_PRODUCER_SEND]
        for _ in range(2):
            clock.now += 1.0
            sends.check_resends(clock.now)
        assert [f.command for f in link.written] == [Command.UP_PRODUCER_SEND] + [Command.UP_PRODUCER_RESEND] * 2
        assert len({f.session_id for f in link.written}) == 1
        assert not task.done()
        clock.now += 1.0
        sends.check_resends(clock.now)
        return await task

    result = asyncio.run(run())
    assert result.status is Status.OUT_OF_RETRY and result.attempts == 3


def test_a_lost_server_moves_its_sends_at_once_and_a_late_connection_gets_the_rest():
    """``link_leaving`` writes the unanswered sends to the other server as resends, using up
    no try; with no other server they wait and go to the first that is ready."""

    async def run():
        sends, links, clock = make("a", "b")
        task = asyncio.ensure_future(sends.send(Message("orders", b"x")))
        await turn()
        (home,) = [link for link in links.values() if link.written]
        (other,) = [link for link in links.values() if link is not home]
        home.state = LinkState.DOWN
        sends.link_leaving(home)
        assert [f.command for f in other.written] == [Command.UP_PRODUCER_RESEND]
        other.state = LinkState.DOWN
        sends.link_leaving(other)  # nowhere to go: it waits
        home.state = LinkState.READY
        sends.link_ready(home)
        assert [f.command for f in home.written] == [Command.UP_PRODUCER_SEND, Command.UP_PRODUCER_RESEND]
        (pending,) = sends.pending.values()
        assert pending.tries == 0
        sends.replies(home, [answer(home, home.written[-1], status="duplicate")])
        return await task

    result = asyncio.run(run())
    assert result.ok and result.duplicate and result.attempts == 3 and result.message_id == 77


def test_a_send_refused_as_the_server_shuts_down_goes_to_the_other_server():
    """SEND_SERVER_ERROR E_SHUTTING_DOWN is no result: the server is marked rebooting and
    its unanswered sends are written to the other server at once, where they are answered."""

    async def run():
        sends, links, clock = make("a", "b")
        tasks = [asyncio.ensure_future(sends.send(Message("orders", b"%d" % i))) for i in range(3)]
        await turn()
        (home,) = [link for link in links.values() if link.written]
        (other,) = [link for link in links.values() if link is not home]
        refused = home.written[0]
        sends.replies(home, [Frame(Command.SEND_SERVER_ERROR, session_id=refused.session_id, topic="orders",
                                   producer="p-1", status="E_SHUTTING_DOWN server is shutting down")])
        assert home.state is LinkState.REBOOTING
        assert [f.command for f in other.written] == [Command.UP_PRODUCER_RESEND] * 3
        assert not any(task.done() for task in tasks)
        sends.replies(other, [answer(other, frame, message_id=i) for i, frame in enumerate(other.written)])
        return await asyncio.gather(*tasks), other

    results, other = asyncio.run(run())
    assert [(r.status, r.server, r.attempts) for r in results] == [(Status.SUCCESS, other.name, 2)] * 3


def test_sends_beyond_max_in_flight_wait_and_a_cancelled_waiter_is_reported_not_sent():
    """With ``max_in_flight`` 1 the second send is not written while the first is
    unanswered; cancelled there, it is reported CANCELLED (never written). A send cancelled
    after its write is answered all the same, and that answer goes to ``on_cancelled``."""
    reports = []

    async def run():
        sends, links, clock = make("a", on_cancelled=reports.append, max_in_flight=1)
        (link,) = links.values()
        first = asyncio.ensure_future(sends.send(Message("orders", b"1")))
        second = asyncio.ensure_future(sends.send(Message("orders", b"2")))
        await turn()
        assert len(link.written) == 1 and not second.done()
        second.cancel()
        first.cancel()  # written: it goes on
        await turn()
        assert [r.status for r in reports] == [Status.CANCELLED]
        sends.replies(link, [answer(link, link.written[0])])
        third = asyncio.ensure_future(sends.send(Message("orders", b"3")))
        await turn()
        assert [f.body for f in link.written] == [b"1", b"3"]  # its room was given back
        await sends.close(0)
        assert (await third).status is Status.CLIENT_CLOSED

    asyncio.run(run())
    assert [(r.status, r.message.body) for r in reports] == [(Status.CANCELLED, b"2"), (Status.SUCCESS, b"1")]
    assert reports[1].message_id == 77


def test_closing_answers_every_unanswered_send_client_closed():
    async def run():
        sends, links, clock = make("a")
        tasks = [asyncio.ensure_future(sends.send(Message("orders", b"%d" % i))) for i in range(3)]
        await turn()
        await sends.close(0)
        late = await sends.send(Message("orders", b"late"))
        return await asyncio.gather(*tasks), late

    results, late = asyncio.run(run())
    assert [r.status for r in results] == [Status.CLIENT_CLOSED] * 3
    assert late.status is Status.CLIENT_CLOSED


# -- the producer journal (dmq_client.aio.journal) ----------------------------------------------


async def journaled(tmp_path, *names: str, on_cancelled=None, **settings):
    """``make`` with the producer journal in ``tmp_path`` (opened as the client opens it)."""
    from dmq_client.aio.journal import AioJournal

    sends, links, clock = make(*names, on_cancelled=on_cancelled, journal_path=str(tmp_path / "journal"),
                               journal_retry_backoff=2.0, **settings)
    sends.journal = await AioJournal.open(sends.config, "p-1")
    sends.kept = KEPT
    return sends, links, clock


def reopened(tmp_path) -> int:
    """How many unfinished records the journal holds now (a new client would send them)."""
    with JournalSendQueue(tmp_path / "journal", ticker=False) as queue:
        return queue.recovered


def test_a_journaled_send_is_written_once_on_disk_and_a_transient_failure_is_retried_not_reported(tmp_path):
    """The frame is written only once the journal holds the record; SEND_SERVER_ERROR is no
    result but a retry after ``journal_retry_backoff`` (as a resend, under the same session
    id); the SUCCESS that follows is the caller's result and the journal forgets the message."""

    async def run():
        sends, links, clock = await journaled(tmp_path, "a")
        (link,) = links.values()
        task = asyncio.ensure_future(sends.send(Message("orders", b"x")))
        await asyncio.sleep(0)
        assert link.written == [] and len(sends._journaling) == 1  # handed to the journal's thread
        await sends.journal.idle()
        (first,) = link.written  # once on disk
        assert sends.journal.queue.journaled == 1
        sends.replies(link, [Frame(Command.SEND_SERVER_ERROR, session_id=first.session_id, topic="orders",
                                   producer="p-1", status="E_STORAGE the database is down")])
        await turn()
        assert not task.done() and sends.retried == 1
        clock.now += 1.9
        sends.check_resends(clock.now)
        assert len(link.written) == 1  # its backoff is not over
        clock.now += 0.2
        link.state = LinkState.READY  # the storage failure made it UNHEALTHY: still usable
        sends.check_resends(clock.now)
        assert [(f.command, f.session_id) for f in link.written] == [
            (Command.UP_PRODUCER_SEND, first.session_id), (Command.UP_PRODUCER_RESEND, first.session_id)]
        sends.replies(link, [answer(link, link.written[-1])])
        result = await task
        await sends.close(0)
        await sends.journal.close()
        return result

    result = asyncio.run(run())
    assert result.ok and result.attempts == 2
    assert reopened(tmp_path) == 0


def test_a_journaled_send_cancelled_after_its_record_is_sent_all_the_same_and_close_keeps_the_rest(tmp_path):
    """Cancelled while waiting for room: CANCELLED, nothing journaled. Cancelled once its
    record was handed to the journal: not withdrawn; written, answered, and that answer goes
    to ``on_cancelled``. A send unanswered at close is CLIENT_CLOSED, kept in the journal:
    the next open recovers it (and only it)."""
    reports = []

    async def run():
        sends, links, clock = await journaled(tmp_path, "a", on_cancelled=reports.append, max_in_flight=2)
        (link,) = links.values()
        tasks = [asyncio.ensure_future(sends.send(Message("orders", b"%d" % i))) for i in range(3)]
        await asyncio.sleep(0)
        tasks[2].cancel()  # waiting for room
        tasks[0].cancel()  # handed to the journal, not written yet
        await sends.journal.idle()
        await turn()
        assert [f.body for f in link.written] == [b"0", b"1"]
        sends.replies(link, [answer(link, link.written[0], message_id=5)])
        await sends.close(0)
        closed = await tasks[1]
        await sends.journal.close()
        return closed

    closed = asyncio.run(run())
    assert [(r.status, r.message.body) for r in reports] == [(Status.CANCELLED, b"2"), (Status.SUCCESS, b"0")]
    assert closed.status is Status.CLIENT_CLOSED and closed.description.endswith(KEPT)
    assert reopened(tmp_path) == 1


def test_recovered_records_are_sent_first_under_their_own_producer_and_reported_to_recovered_callback(tmp_path):
    """What a crashed producer left in the journal goes out as resends under that producer's
    id and session ids when the first server is ready, before a new send; its result goes to
    ``recovered_callback``, and the journal then holds nothing."""
    old = JournalSendQueue(tmp_path / "journal", ticker=False, producer_id="crashed-1")
    for i in range(2):
        old.put(PendingSend(Message("orders", b"old %d" % i), 9000 + i, "crashed-1", 1_700_000_000_000))
    old.abandon()  # as kill -9 leaves it
    recovered = []

    async def run():
        sends, links, clock = await journaled(tmp_path, "a", recovered_callback=recovered.append)
        sends.recover(sends.journal.recovered)
        (link,) = links.values()
        link.state = LinkState.DOWN
        new = asyncio.ensure_future(sends.send(Message("orders", b"new")))
        await turn()
        await sends.journal.idle()
        link.state = LinkState.READY
        sends.link_ready(link)
        assert [(f.command, f.producer, f.session_id, f.body) for f in link.written] == [
            (Command.UP_PRODUCER_RESEND, "crashed-1", 9000, b"old 0"),
            (Command.UP_PRODUCER_RESEND, "crashed-1", 9001, b"old 1"),
            (Command.UP_PRODUCER_SEND, "p-1", link.written[2].session_id, b"new")]
        sends.replies(link, [answer(link, frame, message_id=i, status="duplicate" if i == 0 else "")
                             for i, frame in enumerate(link.written)])
        assert await sends.wait_idle(1.0)
        result = await new
        await sends.close(0)
        await sends.journal.close()
        return result

    result = asyncio.run(run())
    assert result.ok and result.producer == "p-1"
    assert [(r.status, r.producer, r.session_id, r.duplicate) for r in recovered] == [
        (Status.SUCCESS, "crashed-1", 9000, True), (Status.SUCCESS, "crashed-1", 9001, False)]
    assert reopened(tmp_path) == 0


def test_a_journaled_send_failing_past_journal_give_up_after_is_reported_and_forgotten(tmp_path):
    """``journal_give_up_after``: the transient failure that comes once the send has been
    failing that long is its result, and the journal forgets the message."""

    async def run():
        sends, links, clock = await journaled(tmp_path, "a", journal_give_up_after=5.0)
        (link,) = links.values()
        task = asyncio.ensure_future(sends.send(Message("orders", b"x")))
        await turn()
        await sends.journal.idle()
        for _ in range(2):  # failing at 0 s (retried), then at 5 s: given up
            sends.replies(link, [Frame(Command.SEND_SERVER_ERROR, session_id=link.written[-1].session_id,
                                       topic="orders", producer="p-1", status="E_RATE the database is busy")])
            clock.now += 5.0
            sends.check_resends(clock.now)
        await turn()
        assert task.done()
        await sends.journal.close()
        return task.result(), len(link.written)

    result, writes = asyncio.run(run())
    assert (result.status, writes) == (Status.SERVER_ERROR, 2)
    assert reopened(tmp_path) == 0


def test_confirmations_resolve_from_the_server_a_lost_link_or_the_bound_and_none_is_kept():
    """A confirmed send's frame carries its deadline (ms); answered SUCCESS it is watched:
    its SEND_CONSUMED_ACK resolves it CONSUMED; another's link lost resolves it LOST; a
    third never answered is LOST once ``GRACE`` after its deadline passed, not before; a
    send answered with an error is NOT_SENT; a server without CONFIRM is not written to.
    Afterwards the table is empty."""

    async def run():
        sends, links, clock = make("a")
        (link,) = links.values()
        futures = [asyncio.get_running_loop().create_future() for _ in range(4)]
        tasks = [asyncio.ensure_future(sends.send(Message("orders", b"x%d" % i), confirm_ms=2000, consumed=f))
                 for i, f in enumerate(futures)]
        await turn()
        assert [f.credit for f in link.written] == [2000] * 4
        first, second, third, fourth = link.written
        sends.replies(link, [answer(link, first, 1), answer(link, second, 2), answer(link, third, 3),
                             Frame(Command.SEND_INVALID_ACK, session_id=fourth.session_id, producer="p-1",
                                   status="E_INVALID no")])
        results = await asyncio.gather(*tasks)
        assert [r.status for r in results] == [Status.SUCCESS] * 3 + [Status.INVALID_MESSAGE]
        assert futures[3].result().status is ConsumeStatus.NOT_SENT
        assert len(sends.confirms) == 3
        sends.replies(link, [Frame(Command.SEND_CONSUMED_ACK, session_id=first.session_id, message_id=1,
                                   topic="orders", producer="p-1", status=consumed_status(CONSUMED, ["billing"]))])
        consumed = futures[0].result()
        assert (consumed.status, consumed.acked, consumed.message_id) == (ConsumeStatus.CONSUMED, ("billing",), 1)
        clock.now += 2.0 + GRACE - 0.1
        sends.check_resends(clock.now)
        assert not futures[1].done() and not futures[2].done()
        clock.now += 0.2
        sends.check_resends(clock.now)
        lost = futures[1].result()
        assert lost.status is ConsumeStatus.LOST and lost.message_id == 2 and "deadline" in lost.description
        assert futures[2].result().status is ConsumeStatus.LOST
        assert len(sends.confirms) == 0

        late = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(sends.send(Message("orders", b"y"), confirm_ms=60000, consumed=late))
        await turn()
        sends.replies(link, [answer(link, link.written[-1], 5)])
        await task
        sends.link_lost(link)  # as the client reports a lost connection
        assert late.result().status is ConsumeStatus.LOST and "was lost" in late.result().description

        link.features = frozenset()
        older = asyncio.get_running_loop().create_future()
        refused = await sends.send(Message("orders", b"z"), confirm_ms=1000, consumed=older)
        assert refused.status is Status.INVALID_MESSAGE and "CONFIRM" in refused.description
        assert older.result().status is ConsumeStatus.NOT_SENT
        assert len(sends.confirms) == 0

    asyncio.run(run())

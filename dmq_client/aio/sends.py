"""The producer side of the asyncio client: sends awaiting their answer, resends, failover.

``MqClient``'s guarantees (``dmq_client.producer``), on the event loop:

* A send is recorded *before* its frame is written, so a fast answer always finds it, and
  stays recorded until answered. One without an answer for ``resend_interval`` is written
  again as ``UP_PRODUCER_RESEND`` under the same producer and session id (the server answers
  a stored pair with its message id and stores nothing: docs/protocol.md §4.3), up to
  ``resend_tries`` times; then ``OUT_OF_RETRY``.
* When a connection is lost or its server announces a shutdown (``SERVER_REBOOT``, or a send
  answered ``E_SHUTTING_DOWN``), its unanswered sends are written at once to another server,
  as resends; such a failover write uses up no try. With no other server they wait for the
  first connection to come (back) and are written there at once.
* **Backpressure**: at most ``max_in_flight`` sends are written and unanswered; a further
  ``send`` waits for one to be answered (it is not queued in memory without bound).
* **Cancellation**: a ``send`` cancelled before its frame was written was never written: it is
  reported ``Status.CANCELLED`` to ``on_cancelled`` and is certainly not stored. One cancelled
  after it was written is not taken back (it cannot be: the bytes may already be stored) and
  not dropped either: it is resent as any send until it is answered, and its result (SUCCESS
  with its message id, OUT_OF_RETRY, CLIENT_CLOSED, …) goes to ``on_cancelled``. So every
  cancelled send is either stored exactly once or reported as not sent, and each is reported
  once.
* **Confirmation when consumed** (``confirm_ms``): the frame asks the server to report the
  message's consumption; its SUCCESS hands the send's ``consumed`` future to ``Confirms``
  (``dmq_client.aio.confirms``), any other result resolves it ``NOT_SENT``. A server whose
  greeting does not list ``CONFIRM`` is not written to (``E_UNSUPPORTED``), as in ``MqClient``.
* **Closing** waits up to ``close_timeout`` for every unanswered send, then settles the rest
  ``CLIENT_CLOSED`` (their callers, or ``on_cancelled``, get that result): none is left
  without an answer.

With the **producer journal** (``journal_path``; ``dmq_client.aio.journal``) a send is
journaled before it is written, as ``MqClient``'s (``dmq_client.producer``, step 6):

* After its room, the send's record is handed to the journal, and it is written to a server
  only once the record is on disk. With no server it waits for one (no ``route_wait``: its
  failure would be transient, so retried anyway), using up a try per ``resend_interval``.
* A *transient* failure (``message.TRANSIENT``: SOCKET_ERROR, SERVER_ERROR,
  RATE_LIMIT_EXCEEDED, OUT_OF_RETRY) is not reported: the send waits in the *retry pen*
  (still holding its room, so a long outage slows new sends instead of growing memory) for
  ``journal_retry_backoff``, doubling up to ``journal_retry_backoff_max``, and is written
  again as a resend, until a final result, the client's close (``CLIENT_CLOSED``, kept in
  the journal for the next client) or ``journal_give_up_after`` (the failure is reported
  and the journal forgets the message).
* The journal forgets a record once its send's result is final (``message.FINAL``).
* The unfinished records of an earlier client (a crashed process) are sent again first,
  under their own producer and session ids (``UP_PRODUCER_RESEND``: the server stores each
  once); their results go to ``recovered_callback``.
* **Cancellation with the journal**: a send cancelled while it waits for room was never
  journaled nor written: ``CANCELLED``, as without the journal. Once its record was handed
  to the journal it is *accepted* and not taken back, whether or not it was written yet:
  it is sent as any journaled send (or, after a crash, by the next client on the journal),
  and its one outcome goes to ``on_cancelled`` (``SUCCESS``; ``CLIENT_CLOSED`` kept in the
  journal; ``QUEUE_FULL`` ``E_JOURNAL …`` if the journal could not store it, then it was
  never written). ``CANCELLED`` always means: not journaled, not written, not stored.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Callable, Iterable

from ..config import MqConfig
from ..confirm import Consumed
from ..message import TRANSIENT, Message, SendResult, Status
from ..notify import call_callback
from ..outgoing import REPLY_STATUS, check_confirm, check_message, check_server, send_frame
from ..pending import PendingSend
from ..routing import affinity
from ..send_queue import Put
from ..session import SessionIdGenerator
from ..wire import SEND_REPLIES, Command, Frame
from .confirms import Confirms
from .link import LinkState, ServerLink

if TYPE_CHECKING:
    from .journal import AioJournal

__all__ = ["Sends"]

log = logging.getLogger(__name__)



#: a send's key: the server deduplicates and answers by producer and session id
Key = tuple[str, int]


class _Pending:
    """One send from its write (with the journal: its record) to its answer."""

    __slots__ = ("message", "producer", "session_id", "timestamp_ms", "future", "command", "attempts", "tries",
                 "server", "written_at", "detached", "accepted", "room", "record", "retry_at", "failures",
                 "failing_since", "confirm_ms", "consumed")

    def __init__(self, message: Message, producer: str, session_id: int, timestamp_ms: int,
                 future: "asyncio.Future[SendResult]", command: Command = Command.UP_PRODUCER_SEND,
                 confirm_ms: int = 0, consumed: "asyncio.Future[Consumed] | None" = None):
        self.message = message
        self.producer = producer
        self.confirm_ms = confirm_ms  # > 0: the server reports its consumption to ``consumed``
        self.consumed = consumed
        self.session_id = session_id
        self.timestamp_ms = timestamp_ms
        self.future = future
        self.command = command  # of its first write: UP_PRODUCER_RESEND for a resend
        self.attempts = 0  # writes made
        self.tries = 0  # timed resends (failover writes are not counted)
        self.server: str | None = None  # where it was last written; None: waiting for a server
        self.written_at = 0.0
        self.detached = False  # its caller was cancelled: the result goes to on_cancelled
        self.accepted = False  # written, or handed to the journal: a cancellation no longer withdraws it
        self.room = False  # holds a max_in_flight slot (a recovered send does not)
        self.record: PendingSend | None = None  # its journal record (with the journal)
        self.retry_at = 0.0  # in the retry pen until then (journal; 0: not in it)
        self.failures = 0  # transient failures retried (journal)
        self.failing_since = 0.0

    @property
    def key(self) -> Key:
        return (self.producer, self.session_id)


class Sends:
    def __init__(self, config: MqConfig, producer_id: str, links: dict[str, ServerLink],
                 on_cancelled: Callable[[SendResult], object] | None, *,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 journal: AioJournal | None = None):
        self.config = config
        self.producer_id = producer_id
        self.links = links
        self.on_cancelled = on_cancelled
        self.clock = clock
        self.wall_clock = wall_clock
        self.journal = journal
        self.kept = ""  # added to CLIENT_CLOSED descriptions when the journal keeps the message
        if journal is not None:
            from ..journal import KEPT

            self.kept = KEPT
        self.retried = 0  # transient failures of journaled sends turned into a later retry
        self.next_session_id = SessionIdGenerator(wall_clock)
        self.pending: dict[Key, _Pending] = {}
        self._journaling: dict[Key, _Pending] = {}  # handed to the journal, not on disk yet
        self._room = asyncio.Semaphore(config.max_in_flight)
        self._changed = asyncio.Event()  # a link became usable, or the client is closing
        self.closing = False
        self._resender: asyncio.Task[None] | None = None
        self.confirms = Confirms(producer_id)

    def start(self) -> None:
        self._resender = asyncio.get_running_loop().create_task(self._resend_loop(), name="dmq-resend")

    def recover(self, records: list[PendingSend]) -> None:
        """Send a journal's recovered records again (before any new send: they are written
        to the first server ready), under their own producer and session ids, as resends.
        They hold no room (all are taken, as the journal took them); their results go to
        the record's callback (``recovered_callback``, after a log line)."""
        loop = asyncio.get_running_loop()
        for record in records:
            item = _Pending(record.message, record.producer, record.session_id, record.timestamp_ms,
                            loop.create_future(), Command.UP_PRODUCER_RESEND)
            item.accepted = True
            item.record = record
            item.written_at = self.clock()
            item.future.add_done_callback(functools.partial(self._recovered_result, record))
            self.pending[item.key] = item
            self._move([item])

    @staticmethod
    def _recovered_result(record: PendingSend, future: "asyncio.Future[SendResult]") -> None:
        result = future.result()
        try:
            call_callback(record.callback, result)
        except Exception:
            log.exception("recovered_callback raised for send %s", result.session_id)

    # -- the caller's side ------------------------------------------------------------
    async def send(self, message: Message, resend: bool = False, producer: str | None = None, *,
                   confirm_ms: int = 0, consumed: "asyncio.Future[Consumed] | None" = None) -> SendResult:
        """``resend``: the message (with its session id) may have been stored by an earlier
        send: its first write is ``UP_PRODUCER_RESEND`` too, answered with the stored id.
        ``producer``: the id it was first sent under (a result of a journal's recovered
        send keeps its own); this client's by default. ``confirm_ms`` > 0: ask for its
        consumption within that many ms, reported to ``consumed``."""
        result = await self._send(message, resend, producer, confirm_ms, consumed)
        if consumed is not None and not result.ok:  # refused before it had a _Pending
            self.confirms.settled(consumed, result, confirm_ms, self.clock())
        return result

    async def _send(self, message: Message, resend: bool, producer: str | None, confirm_ms: int,
                    consumed: "asyncio.Future[Consumed] | None") -> SendResult:
        if not isinstance(message, Message):
            raise TypeError(f"send() takes a dmq_client.Message, not {type(message).__name__}")
        if self.closing:
            return self._result(message, None, Status.CLIENT_CLOSED, "the client is closed")
        problem = check_message(message, self.config.max_body_size) or check_confirm(message, confirm_ms)
        if problem:
            return self._result(message, message.session_id, Status.INVALID_MESSAGE, problem)
        session_id = self.next_session_id() if message.session_id is None else message.session_id
        producer = producer or self.producer_id
        if (producer, session_id) in self.pending or (producer, session_id) in self._journaling:
            return self._result(message, session_id, Status.INVALID_MESSAGE,
                                f"E_INVALID session id {session_id} is already awaiting its answer", producer)
        item = _Pending(message, producer, session_id, int(self.wall_clock() * 1000),
                        asyncio.get_running_loop().create_future(),
                        Command.UP_PRODUCER_RESEND if resend else Command.UP_PRODUCER_SEND, confirm_ms, consumed)
        try:
            await self._room.acquire()  # backpressure: max_in_flight written and unanswered
            item.room = True
            if self.journal is not None:
                if self.closing:
                    self._room.release()
                    return self._result(message, session_id, Status.CLIENT_CLOSED, "the client is closed", producer)
                self._journal(item, self.journal)  # accepted: from here on it is not taken back
                return await asyncio.shield(item.future)
            try:
                link = await self._route(message.topic)
            except BaseException:
                self._room.release()
                raise
            if link is None or self.closing:
                self._room.release()
                if self.closing:
                    return self._result(message, session_id, Status.CLIENT_CLOSED, "the client is closed", producer)
                return self._result(message, session_id, Status.SOCKET_ERROR,
                                    f"no server connection within route_wait ({self.config.route_wait}s)", producer)
            problem = check_server(message, confirm_ms, link.name, link.features)
            if problem:
                self._room.release()
                return self._result(message, session_id, Status.INVALID_MESSAGE, problem, producer)
            self.pending[item.key] = item  # before the write: a fast answer finds it
            self._write(item, link, item.command)
            await link.drain()
            return await asyncio.shield(item.future)
        except asyncio.CancelledError:
            if not item.accepted:
                self._report(self._result(message, session_id, Status.CANCELLED,
                                          "the send was cancelled before it was written", producer))
            else:
                item.detached = True
                if item.future.done():  # answered in the same turn as the cancellation
                    self._report(item.future.result())
            raise

    def _result(self, message: Message, session_id: int | None, status: Status, description: str,
                producer: str | None = None) -> SendResult:
        return SendResult(status, message, session_id, description=description, producer=producer or self.producer_id)

    # -- the journal ------------------------------------------------------------------
    def _journal(self, item: _Pending, journal: AioJournal) -> None:
        """Hand the send's record to the journal; it is written once the record is on disk."""
        item.accepted = True
        item.record = PendingSend(item.message, item.session_id, item.producer, item.timestamp_ms,
                                  resend=item.command is Command.UP_PRODUCER_RESEND)
        self._journaling[item.key] = item
        journal.put(item.record, lambda answer, why: self._journaled(item, answer, why))

    def _journaled(self, item: _Pending, answer: Put, why: str) -> None:
        del self._journaling[item.key]
        if answer is not Put.ACCEPTED:
            item.record = None  # never journaled: nothing to forget
            if answer is Put.CLOSED:
                self._settle(item, Status.CLIENT_CLOSED, "the client is closed")
            else:
                self._settle(item, Status.QUEUE_FULL, why or "E_JOURNAL the producer journal could not store the message")
            return
        link = self.pick(item.message.topic)
        problem = "" if link is None else check_server(item.message, item.confirm_ms, link.name, link.features)
        if problem:  # refused for good: the journal forgets it
            self._settle(item, Status.INVALID_MESSAGE, problem)
            return
        self.pending[item.key] = item
        item.written_at = self.clock()
        self._move([item])

    def _retry_later(self, item: _Pending) -> bool:
        """A journaled send failed transiently: into the retry pen (True), unless
        ``journal_give_up_after`` ran out (then its record is marked given up)."""
        assert item.record is not None
        now = self.clock()
        if item.failures == 0:
            item.failing_since = now
        give_up = self.config.journal_give_up_after
        if give_up is not None and now - item.failing_since >= give_up:
            item.record.given_up = True
            return False
        item.failures += 1
        backoff = self.config.journal_retry_backoff * 2 ** min(item.failures - 1, 30)
        item.retry_at = now + min(backoff, self.config.journal_retry_backoff_max)
        item.server = None
        self.retried += 1
        return True

    def _report(self, result: SendResult) -> None:
        if self.on_cancelled is None:
            log.info("cancelled send %s: %s %s", result.session_id, result.status.value, result.description)
            return
        try:
            self.on_cancelled(result)
        except Exception:
            log.exception("on_cancelled raised for send %s", result.session_id)

    # -- routing and writing ----------------------------------------------------------
    def pick(self, topic: str, exclude: Iterable[str] = ()) -> ServerLink | None:
        """The topic's server now: the best-scoring READY one (``routing.affinity``, as
        ``MqClient``), else the best UNHEALTHY one, else None."""
        for state in (LinkState.READY, LinkState.UNHEALTHY):
            usable = [link for link in self.links.values() if link.state is state and link.name not in exclude]
            if usable:
                return max(usable, key=lambda link: affinity(topic, link.name))
        return None

    async def _route(self, topic: str) -> ServerLink | None:
        link = self.pick(topic)
        if link is not None or self.closing:
            return link
        deadline = self.clock() + self.config.route_wait
        while link is None and not self.closing:
            remaining = deadline - self.clock()
            if remaining <= 0:
                return None
            self._changed.clear()
            try:
                async with asyncio.timeout(remaining):  # not wait_for: it may swallow a cancellation
                    await self._changed.wait()
            except TimeoutError:
                pass
            link = self.pick(topic)
        return link

    def _write(self, item: _Pending, link: ServerLink, command: Command) -> None:
        item.attempts += 1
        item.accepted = True
        item.written_at = self.clock()
        frame = send_frame(item.message, command, item.session_id, item.producer, item.timestamp_ms, item.confirm_ms)
        if link.write(frame):
            item.server = link.name
        else:  # lost between the pick and the write: the next connection takes it
            item.server = None

    def _move(self, items: list[_Pending], exclude: Iterable[str] = ()) -> None:
        """Write ``items`` again at once, as resends, each to its topic's server but those in
        ``exclude``; with none usable they wait for the next connection (``link_ready``)."""
        for item in items:
            link = self.pick(item.message.topic, exclude)
            if link is None:
                item.server = None
            else:
                self._write(item, link, Command.UP_PRODUCER_RESEND if item.attempts else item.command)

    # -- what the links report -------------------------------------------------------
    def link_ready(self, link: ServerLink) -> None:
        self._changed.set()
        waiting = [item for item in self.pending.values() if item.server is None and not item.retry_at]
        if waiting:
            log.info("writing %d unanswered sends to %s", len(waiting), link.name)
            self._move(waiting)

    def link_leaving(self, link: ServerLink) -> None:
        """Lost, or shutting down: its unanswered sends go elsewhere now."""
        moved = [item for item in self.pending.values() if item.server == link.name]
        if moved:
            log.info("failing over %d unanswered sends from %s", len(moved), link.name)
            self._move(moved, exclude=(link.name,))

    def link_lost(self, link: ServerLink) -> None:
        """The connection is gone, and the confirmations its server was watching with it."""
        self.confirms.lost(link.name)

    def replies(self, link: ServerLink, frames: list[Frame]) -> None:
        """SEND_* replies and SEND_CONSUMED_ACKs, in the order read (a send's SUCCESS
        registers what a SEND_CONSUMED_ACK after it answers)."""
        for frame in frames:
            if frame.command == Command.SEND_CONSUMED_ACK:
                self.confirms.reports([frame])
                continue
            if frame.command not in SEND_REPLIES:
                continue
            # the server echoes the producer; a reply without one is for this client's own
            item = self.pending.get((frame.producer or self.producer_id, frame.session_id))
            if item is None:
                continue  # answered already (a resend's second answer)
            status = REPLY_STATUS[frame.command]
            if status is Status.SERVER_ERROR:
                if frame.status.startswith("E_SHUTTING_DOWN"):
                    link.mark_rebooting()  # moves this send with the others
                    continue
                if frame.status.startswith("E_STORAGE"):
                    link.mark_unhealthy(frame.status)
            ok = status is Status.SUCCESS
            self._settle(item, status, "" if ok else frame.status, server=link.name,
                         message_id=frame.message_id if ok else None, duplicate=ok and frame.status == "duplicate")

    def _settle(self, item: _Pending, status: Status, description: str = "", *, server: str | None = None,
                message_id: int | None = None, duplicate: bool = False) -> None:
        if item.future.done():
            return
        record = item.record
        if record is not None and status in TRANSIENT and self._retry_later(item):
            return  # retried later: it stays pending (and keeps its room)
        if self.pending.get(item.key) is item:
            del self.pending[item.key]
        if item.room:
            self._room.release()
        result = SendResult(status, item.message, item.session_id, message_id=message_id, description=description,
                            server=item.server if server is None else server, duplicate=duplicate,
                            attempts=item.attempts, producer=item.producer)
        item.future.set_result(result)
        if item.consumed is not None:
            self.confirms.settled(item.consumed, result, item.confirm_ms, self.clock())
        if item.detached:
            self._report(result)
        if record is not None and self.journal is not None:
            record.result = result
            self.journal.finished(record)  # forgotten if final (or given up), else kept

    # -- resends ------------------------------------------------------------------------
    async def _resend_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.resend_check_interval)
            self.check_resends(self.clock())

    def check_resends(self, now: float) -> None:
        """Resend what has waited ``resend_interval`` without an answer; OUT_OF_RETRY after
        ``resend_tries`` resends. A send with no server to go to uses up its try all the
        same, so OUT_OF_RETRY comes on time when no server is reachable. Confirmations
        not answered ``GRACE`` after their deadline are given up (``LOST``)."""
        self.confirms.expired(now)
        interval = self.config.resend_interval
        for item in list(self.pending.values()):
            if item.retry_at:  # in the retry pen (journal): out once its backoff is over
                if now >= item.retry_at:
                    item.retry_at = 0.0
                    item.tries = 0  # a fresh resend schedule for the new write
                    item.written_at = now
                    self._move([item])
                continue
            if now - item.written_at < interval:
                continue
            if item.tries >= self.config.resend_tries:
                self._settle(item, Status.OUT_OF_RETRY,
                             f"no answer after {item.attempts} writes; the message may or may not be stored "
                             "(resending it under its session id is safe)")
                continue
            item.tries += 1
            link = self.pick(item.message.topic)
            if link is None:
                item.written_at = now
                item.server = None
            else:
                self._write(item, link, Command.UP_PRODUCER_RESEND)

    async def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no send is unanswered (those handed to the journal included); False
        after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.pending or self._journaling:
            futures = [item.future for item in (*self.pending.values(), *self._journaling.values())]
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            await asyncio.wait(futures, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        return True

    # -- closing ------------------------------------------------------------------------
    async def close(self, timeout: float) -> None:
        """New sends get CLIENT_CLOSED; wait up to ``timeout`` for the unanswered ones, then
        settle the rest CLIENT_CLOSED."""
        self.closing = True
        self._changed.set()  # sends waiting for a server give up now
        if self.journal is not None:
            await self.journal.idle()  # the records handed over are on disk: their sends are pending
        waiting = [item.future for item in self.pending.values()]
        if waiting and timeout > 0:
            await asyncio.wait(waiting, timeout=timeout)
        if self._resender is not None:
            self._resender.cancel()
        for item in list(self.pending.values()):
            kept = self.kept if item.record is not None else ""
            self._settle(item, Status.CLIENT_CLOSED,
                         ("the client closed before the server answered; the message may or may not be stored"
                          if item.attempts else "the client closed before the message was written") + kept)
        self.confirms.close()

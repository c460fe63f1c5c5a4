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
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterable

from ..config import MqConfig
from ..confirm import Consumed
from ..message import Message, SendResult, Status
from ..outgoing import REPLY_STATUS, check_confirm, check_message, check_server, send_frame
from ..routing import affinity
from ..session import SessionIdGenerator
from ..wire import SEND_REPLIES, Command, Frame
from .confirms import Confirms
from .link import LinkState, ServerLink

__all__ = ["Sends"]

log = logging.getLogger(__name__)



class _Pending:
    """One send from its write to its answer."""

    __slots__ = ("message", "session_id", "timestamp_ms", "future", "attempts", "tries", "server",
                 "written_at", "detached", "confirm_ms", "consumed")

    def __init__(self, message: Message, session_id: int, timestamp_ms: int, future: "asyncio.Future[SendResult]",
                 confirm_ms: int = 0, consumed: "asyncio.Future[Consumed] | None" = None):
        self.message = message
        self.confirm_ms = confirm_ms  # > 0: the server reports its consumption to ``consumed``
        self.consumed = consumed
        self.session_id = session_id
        self.timestamp_ms = timestamp_ms
        self.future = future
        self.attempts = 0  # writes made
        self.tries = 0  # timed resends (failover writes are not counted)
        self.server: str | None = None  # where it was last written; None: waiting for a server
        self.written_at = 0.0
        self.detached = False  # its caller was cancelled: the result goes to on_cancelled


class Sends:
    def __init__(self, config: MqConfig, producer_id: str, links: dict[str, ServerLink],
                 on_cancelled: Callable[[SendResult], object] | None, *,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time):
        self.config = config
        self.producer_id = producer_id
        self.links = links
        self.on_cancelled = on_cancelled
        self.clock = clock
        self.wall_clock = wall_clock
        self.next_session_id = SessionIdGenerator(wall_clock)
        self.pending: dict[int, _Pending] = {}
        self._room = asyncio.Semaphore(config.max_in_flight)
        self._changed = asyncio.Event()  # a link became usable, or the client is closing
        self.closing = False
        self._resender: asyncio.Task[None] | None = None
        self.confirms = Confirms(producer_id)

    def start(self) -> None:
        self._resender = asyncio.get_running_loop().create_task(self._resend_loop(), name="dmq-resend")

    # -- the caller's side ------------------------------------------------------------
    async def send(self, message: Message, resend: bool = False, *, confirm_ms: int = 0,
                   consumed: "asyncio.Future[Consumed] | None" = None) -> SendResult:
        """``resend``: the message (with its session id) may have been stored by an earlier
        send: its first write is ``UP_PRODUCER_RESEND`` too, answered with the stored id.
        ``confirm_ms`` > 0: ask for its consumption within that many ms, reported to
        ``consumed``."""
        result = await self._send(message, resend, confirm_ms, consumed)
        if consumed is not None and not result.ok:  # refused before it had a _Pending
            self.confirms.settled(consumed, result, confirm_ms, self.clock())
        return result

    async def _send(self, message: Message, resend: bool, confirm_ms: int,
                    consumed: "asyncio.Future[Consumed] | None") -> SendResult:
        if not isinstance(message, Message):
            raise TypeError(f"send() takes a dmq_client.Message, not {type(message).__name__}")
        if self.closing:
            return self._result(message, None, Status.CLIENT_CLOSED, "the client is closed")
        problem = check_message(message, self.config.max_body_size) or check_confirm(message, confirm_ms)
        if problem:
            return self._result(message, message.session_id, Status.INVALID_MESSAGE, problem)
        session_id = self.next_session_id() if message.session_id is None else message.session_id
        if session_id in self.pending:
            return self._result(message, session_id, Status.INVALID_MESSAGE,
                                f"E_INVALID session id {session_id} is already awaiting its answer")
        item = _Pending(message, session_id, int(self.wall_clock() * 1000),
                        asyncio.get_running_loop().create_future(), confirm_ms, consumed)
        try:
            await self._room.acquire()  # backpressure: max_in_flight written and unanswered
            try:
                link = await self._route(message.topic)
            except BaseException:
                self._room.release()
                raise
            if link is None or self.closing:
                self._room.release()
                if self.closing:
                    return self._result(message, session_id, Status.CLIENT_CLOSED, "the client is closed")
                return self._result(message, session_id, Status.SOCKET_ERROR,
                                    f"no server connection within route_wait ({self.config.route_wait}s)")
            problem = check_server(message, confirm_ms, link.name, link.features)
            if problem:
                self._room.release()
                return self._result(message, session_id, Status.INVALID_MESSAGE, problem)
            self.pending[session_id] = item  # before the write: a fast answer finds it
            self._write(item, link, Command.UP_PRODUCER_RESEND if resend else Command.UP_PRODUCER_SEND)
            await link.drain()
            return await asyncio.shield(item.future)
        except asyncio.CancelledError:
            if item.attempts == 0:
                self._report(self._result(message, session_id, Status.CANCELLED,
                                          "the send was cancelled before it was written"))
            else:
                item.detached = True
                if item.future.done():  # answered in the same turn as the cancellation
                    self._report(item.future.result())
            raise

    def _result(self, message: Message, session_id: int | None, status: Status, description: str) -> SendResult:
        return SendResult(status, message, session_id, description=description, producer=self.producer_id)

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
        item.written_at = self.clock()
        frame = send_frame(item.message, command, item.session_id, self.producer_id, item.timestamp_ms, item.confirm_ms)
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
                self._write(item, link, Command.UP_PRODUCER_RESEND)

    # -- what the links report -------------------------------------------------------
    def link_ready(self, link: ServerLink) -> None:
        self._changed.set()
        waiting = [item for item in self.pending.values() if item.server is None]
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
            if frame.command not in SEND_REPLIES or (frame.producer and frame.producer != self.producer_id):
                continue
            item = self.pending.get(frame.session_id)
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
        if self.pending.get(item.session_id) is item:
            del self.pending[item.session_id]
        self._room.release()
        result = SendResult(status, item.message, item.session_id, message_id=message_id, description=description,
                            server=item.server if server is None else server, duplicate=duplicate,
                            attempts=item.attempts, producer=self.producer_id)
        item.future.set_result(result)
        if item.consumed is not None:
            self.confirms.settled(item.consumed, result, item.confirm_ms, self.clock())
        if item.detached:
            self._report(result)

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

    # -- closing ------------------------------------------------------------------------
    async def close(self, timeout: float) -> None:
        """New sends get CLIENT_CLOSED; wait up to ``timeout`` for the unanswered ones, then
        settle the rest CLIENT_CLOSED."""
        self.closing = True
        self._changed.set()  # sends waiting for a server give up now
        waiting = [item.future for item in self.pending.values()]
        if waiting and timeout > 0:
            await asyncio.wait(waiting, timeout=timeout)
        if self._resender is not None:
            self._resender.cancel()
        for item in list(self.pending.values()):
            self._settle(item, Status.CLIENT_CLOSED,
                         "the client closed before the server answered; the message may or may not be stored"
                         if item.attempts else "the client closed before the message was written")
        self.confirms.close()

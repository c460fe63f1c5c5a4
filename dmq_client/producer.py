"""The producer side of the client: send queue, send runner, resend runner, replies.

The flow is DMQ's (seeds/003, section 2):

1. ``send`` checks the message; an invalid one goes straight to the notify
   queue (INVALID_MESSAGE), and so does one the bounded send queue has no
   room for (QUEUE_FULL): ``send`` never blocks.
2. The send runner takes batches from the queue, routes each message by topic
   to a server (waiting up to ``route_wait`` for one; SOCKET_ERROR if none),
   records it in the resend map *before* writing (so a fast reply always
   finds it) and writes the batch for a server in one socket write.
3. A reply removes the message from the resend map and queues its result
   for the notify runner, which calls the callback and completes the future.
4. The resend runner wakes every ``resend_check_interval`` and resends, with
   UP_PRODUCER_RESEND, whatever has waited ``resend_interval`` for a reply,
   up to ``resend_tries`` times; then OUT_OF_RETRY.
5. When a server connection fails, or the server answers that it is shutting
   down, the messages waiting on it are written at once to another server
   (as resends: the server deduplicates by producer and session id, and all
   nodes share one store). Such a failover write uses up no try.
6. With the producer journal, a transient failure of a journaled send
   (``message.TRANSIENT``: SOCKET_ERROR, SERVER_ERROR, RATE_LIMIT_EXCEEDED,
   OUT_OF_RETRY) is not reported: the message waits in the *retry pen* for a
   backoff (``journal_retry_backoff``, doubling up to
   ``journal_retry_backoff_max``) and goes back to the send queue as a resend,
   until it gets a ``message.FINAL`` result, the client closes (CLIENT_CLOSED:
   it stays journaled for the next client) or ``journal_give_up_after`` runs
   out (the application's explicit choice to give up: then the failure is
   reported and the journal forgets the message). A journaled message that
   was never stored is therefore never dropped by the client.

A resend of a ``(producer, session_id)`` that is already awaiting its reply
(a journal replay next to its own resend copy, ``client.resend`` of a send
still in flight) is the same message: it is not written again but shares the
first copy's answer (``ResendMap.add_many``).

Every accepted message ends in exactly one result: ``PendingSend.settle``
lets only the first of the competing paths (reply, give-up, close) report.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import defaultdict
from typing import Callable, Iterable

from .config import MqConfig
from .confirm import GRACE, ConfirmingSend, Consumed, ConsumedNote, ConsumeStatus, Watching
from .connection import ConnectionUnavailable, ServerConnection
from .future import SendFuture
from .message import TRANSIENT, Message, SendResult, Status
from .notify import NotifyRunner
from .outgoing import REPLY_STATUS, check_confirm, check_message, check_server, send_frame
from .pending import PendingSend, SendCallback
from .resend import ResendMap
from .routing import ServerPool
from .send_queue import MemorySendQueue, Put, RetryingSendQueue, SendQueue
from .session import SessionIdGenerator, default_producer_id
from .wire import Command, Frame, parse_consumed

__all__ = ["Producer"]

log = logging.getLogger(__name__)

_SHUTTING_DOWN = "E_SHUTTING_DOWN"
_SEND = Command.UP_PRODUCER_SEND
_RESEND = Command.UP_PRODUCER_RESEND
_PENNED = object()  # _retry_later: the send waits in the retry pen
_PEN_CLOSED = object()  # _retry_later: the client is closing; report CLIENT_CLOSED (kept in the journal)


class Producer:
    def __init__(
        self,
        config: MqConfig,
        pool: ServerPool,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        send_queue: SendQueue | None = None,
    ):
        self.config = config
        self.pool = pool
        self.clock = clock
        self.wall_clock = wall_clock
        self._owns_queue = send_queue is None
        if send_queue is None:
            if config.journal_path is not None:
                from .journal import JournalSendQueue  # only loaded when the journal is on

                send_queue = JournalSendQueue.from_config(config)
            else:
                send_queue = MemorySendQueue(config.send_queue_size)
        self.queue: SendQueue = send_queue
        # a journal's recovered messages carry the producer id they were first sent with
        self.producer_id = getattr(send_queue, "producer_id", None) or config.producer_id or default_producer_id()
        self.next_session_id = SessionIdGenerator(wall_clock)
        self._kept = ""  # added to CLIENT_CLOSED descriptions when the queue keeps those messages
        if getattr(send_queue, "keeps_unfinished", False):
            from .journal import KEPT

            self._kept = KEPT
        # a journal retries its transient failures (module docstring, step 6)
        self._retry_queue: RetryingSendQueue | None = (
            send_queue if getattr(send_queue, "retries_unfinished", False)
            and isinstance(send_queue, RetryingSendQueue) else None)
        self._retrying = self._retry_queue is not None
        self._pen: list[tuple[float, int, PendingSend]] = []  # heap of (due, order, item)
        self._pen_order = itertools.count()
        self._pen_lock = threading.Lock()
        self._pen_closed = False
        self.retried = 0  # transient failures turned into a later retry
        self.resends = ResendMap(config.max_in_flight, config.resend_interval, config.resend_tries)
        self.notify = NotifyRunner(self._delivered)
        self.watching: Watching[ConfirmingSend] = Watching()  # sends whose SEND_CONSUMED_ACK is awaited (dmq_client.confirm)
        self._outstanding = len(self.queue)  # a journal's recovered messages are outstanding
        self._idle = threading.Condition(threading.Lock())
        self._closing = False
        self._stop = threading.Event()
        self._send_thread = threading.Thread(target=self._send_loop, name="dmq-send", daemon=True)
        self._resend_thread = threading.Thread(target=self._resend_loop, name="dmq-resend", daemon=True)

    def start(self) -> None:
        self.notify.start()
        self._send_thread.start()
        self._resend_thread.start()

    @property
    def outstanding(self) -> int:
        """Sends accepted whose result has not been delivered yet."""
        return self._outstanding

    # -- the caller's side ----------------------------------------------------
    def send(
        self, message: Message, callback: SendCallback | None = None, *, resend: bool = False,
        producer: str | None = None, confirm_ms: int = 0, on_consumed: Callable[[Consumed], object] | None = None,
    ) -> "SendFuture[SendResult]":
        """``producer``: the id to send under (``client.resend`` of a recovered message
        passes the id it was first sent with); the client's own by default. ``confirm_ms``:
        ask the server to report the message's consumption within that many ms (the
        future is then a ``confirm.ConfirmFuture``; ``on_consumed`` gets its outcome)."""
        if not isinstance(message, Message):
            raise TypeError(f"send() takes a dmq_client.Message, not {type(message).__name__}")
        sid = message.session_id
        session_id = self.next_session_id() if sid is None else sid
        item: PendingSend
        if confirm_ms:
            item = ConfirmingSend(message, session_id, producer or self.producer_id, int(self.wall_clock() * 1000),
                                  callback, resend=resend, confirm_ms=confirm_ms, on_consumed=on_consumed)
        else:
            item = PendingSend(message, session_id, producer or self.producer_id, int(self.wall_clock() * 1000),
                               callback, resend=resend)
        with self._idle:
            self._outstanding += 1
        problem = self._check(message) or check_confirm(message, item.confirm_ms)
        if problem:
            self._finish(item, Status.INVALID_MESSAGE, problem)
            return item.future
        put = self.queue.put(item)
        if put is not Put.ACCEPTED:
            if put is Put.FULL:
                self._finish(item, Status.QUEUE_FULL, f"send queue full ({self.config.send_queue_size} messages)")
            elif put is Put.FAILED:
                why = getattr(self.queue, "last_error", "") or "E_JOURNAL the send queue could not store the message"
                self._finish(item, Status.QUEUE_FULL, why)
            else:
                self._finish(item, Status.CLIENT_CLOSED, "the client is closed")
        return item.future

    def _check(self, message: Message) -> str:
        """Why the message cannot be sent, or ''."""
        return check_message(message, self.config.max_body_size)

    def _frame(self, item: PendingSend, command: Command) -> bytes:
        return send_frame(item.message, command, item.session_id, item.producer, item.timestamp_ms, item.confirm_ms)

    # -- results ----------------------------------------------------------------
    def _finish(self, item: PendingSend, status: Status, description: str = "") -> None:
        done = self._settle(item, status, description)
        if done:
            self.notify.put_many(done)

    def _settle(self, item: PendingSend, status: Status, description: str = "", *, message_id: int | None = None,
                server: str | None = None, duplicate: bool = False) -> list[PendingSend]:
        """Give ``item`` its result, unless a transient failure of a journaled send is to
        be retried instead. Returns the items whose results are to be delivered: the
        item and its followers (resends of the same message that shared its write), or
        nothing (already settled by a competing path, or retried later). ``server``:
        where the answer came from (the server it was last written to by default)."""
        if status in TRANSIENT and self._retrying:
            verdict = self._retry_later(item)
            if verdict is _PENNED:
                return []
            if verdict is _PEN_CLOSED:
                status = Status.CLIENT_CLOSED
                description = f"the client closed before the message was stored ({description}){self._kept}"
        if not item.settle():
            return []
        if server is None:
            server = item.server
        item.result = SendResult(
            status, item.message, item.session_id, message_id=message_id, description=description, server=server,
            duplicate=duplicate, attempts=item.attempts, producer=item.producer,
        )
        if not item.followers:
            return [item]
        done = [item]
        for follower in item.followers:
            # the same (producer, session id): the server's answer to the first copy is the
            # answer to this one; a stored message is a duplicate for it
            if follower.settle():
                follower.given_up = item.given_up
                follower.result = SendResult(
                    status, follower.message, follower.session_id, message_id=message_id, description=description,
                    server=server, duplicate=status is Status.SUCCESS, attempts=follower.attempts,
                    producer=follower.producer,
                )
                done.append(follower)
        return done

    def _retry_later(self, item: PendingSend) -> object:
        """Put a journaled send that failed transiently in the retry pen. Returns
        ``_PENNED``, ``_PEN_CLOSED`` (the client is closing), or None: not journaled
        (refused by the queue), or ``journal_give_up_after`` ran out (then marked
        ``given_up``, so the journal forgets it once its failure is delivered)."""
        now = self.clock()
        with self._pen_lock:
            if self._pen_closed:
                return _PEN_CLOSED
            if item.failures == 0:
                item.failing_since = now
            give_up = self.config.journal_give_up_after
            if give_up is not None and now - item.failing_since >= give_up:
                item.given_up = True
                return None
            if self._retry_queue is None or not self._retry_queue.hold(item):
                return None
            item.failures += 1
            backoff = self.config.journal_retry_backoff * 2 ** min(item.failures - 1, 30)
            due = now + min(backoff, self.config.journal_retry_backoff_max)
            heapq.heappush(self._pen, (due, next(self._pen_order), item))
            self.retried += 1
        return _PENNED

    def release_retries(self, now: float) -> int:
        """Move the sends whose retry backoff is over back to the send queue, as resends
        (the resend runner calls this; tests call it with an injected clock)."""
        retry_queue = self._retry_queue
        if retry_queue is None:  # nothing is ever held: the pen stays empty
            return 0
        with self._pen_lock:
            pen = self._pen
            due: list[PendingSend] = []
            while pen and pen[0][0] <= now:
                due.append(heapq.heappop(pen)[2])
            if due:
                for item in due:
                    item.resends = 0  # a fresh resend schedule for the new write
                    item.resend = True  # it may have been written (and stored) already
                # under the pen's lock, so close() cannot miss an item between pen and queue
                retry_queue.requeue(due)
        return len(due)

    @property
    def retrying(self) -> int:
        """Journaled sends waiting in the retry pen."""
        return len(self._pen)

    def _close_pen(self) -> list[PendingSend]:
        with self._pen_lock:
            self._pen_closed = True
            items = [item for _, _, item in self._pen]
            self._pen.clear()
            if items and self._retry_queue is not None:  # only a retrying queue held them
                self._retry_queue.unhold(len(items))
        return items

    def _delivered(self, item: PendingSend | ConsumedNote) -> None:
        """The notify runner delivered ``item``'s result."""
        if isinstance(item, ConsumedNote):
            return  # a send's second result: its first was counted
        self.queue.task_done(item)
        if isinstance(item, ConfirmingSend) and item.result is not None and not item.result.ok:
            # nothing stored, nothing to confirm: said right after the send's result, on this thread
            result = item.result
            self.notify.deliver(item.outcome(ConsumeStatus.NOT_SENT, result.description or result.status.value))
        with self._idle:
            self._outstanding -= 1
            if self._outstanding == 0:
                self._idle.notify_all()

    def wait_idle(self, timeout: float | None) -> bool:
        """Block until every accepted send has had its result delivered."""
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout)

    # -- the send runner --------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            batch = self.queue.get_batch(self.config.send_batch_size, None)
            if not batch:
                if self._stop.is_set():
                    break
                if self._closing:
                    if not self._pen:
                        break
                    # closing, and journaled sends wait in the retry pen: they may still be
                    # stored within close_timeout. A closed queue does not block when empty,
                    # so wait for the resend runner's next release instead.
                    self._stop.wait(self.config.resend_check_interval)
                continue
            try:
                self._send_batch(batch)
            except Exception as exc:  # a bug, not a network failure: report it, keep running
                log.exception("dmq send runner failed on a batch")
                for item in batch:
                    if item.key not in self.resends:
                        self._finish(item, Status.SOCKET_ERROR, f"internal error before the write: {exc!r}")
        self._abort(self.queue.drain(), "the client closed before the message was written")

    def _send_batch(self, batch: list[PendingSend]) -> None:
        groups: dict[ServerConnection, list[PendingSend]] = defaultdict(list)
        self.resends.wait_for_room(len(batch))
        route_deadline = None  # one route_wait per batch, not per message, during an outage
        for item in batch:
            if self._stop.is_set():
                why = "the client closed before the message was written" + self._kept
                self._finish(item, Status.CLIENT_CLOSED, why)
                continue
            conn = self.pool.pick(item.message.topic)
            if conn is None:
                if route_deadline is None:
                    route_deadline = time.monotonic() + self.config.route_wait
                wait = max(0.0, route_deadline - time.monotonic())
                conn = self.pool.wait_pick(item.message.topic, wait, self._stop)
            if conn is None:
                if self._stop.is_set():
                    why = "the client closed before the message was written" + self._kept
                    self._finish(item, Status.CLIENT_CLOSED, why)
                else:
                    self._finish(
                        item, Status.SOCKET_ERROR,
                        f"no usable connection to any of {len(self.pool)} servers within {self.config.route_wait}s",
                    )
                continue
            problem = check_server(item.message, item.confirm_ms, conn.name, conn.features)
            if problem:
                self._finish(item, Status.INVALID_MESSAGE, problem)
                continue
            groups[conn].append(item)
        for conn, items in groups.items():
            items, refused = self.resends.add_many(items, conn.name, self.clock())
            for item in refused:  # a new send reusing a caller-chosen session id in flight
                why = f"E_INVALID session id {item.session_id} is already awaiting a reply"
                self._finish(item, Status.INVALID_MESSAGE, why)
            if not items:
                continue
            try:
                conn.write(b"".join([self._frame(i, _RESEND if i.resend else _SEND) for i in items]))
            except ConnectionUnavailable as exc:
                log.info("%s; failing over %d sends", exc, len(items))
                self._fail_over(conn, items)

    # -- the resend runner ------------------------------------------------------
    def _resend_loop(self) -> None:
        while not self._stop.wait(self.config.resend_check_interval):
            try:
                self.check_resends()
            except Exception:
                log.exception("dmq resend runner failed; continuing")

    def check_resends(self, now: float | None = None) -> None:
        """One pass of the resend runner (tests call it with an injected clock)."""
        now = self.clock() if now is None else now
        if self._retrying:
            self.release_retries(now)
        resend, expired = self.resends.due(now)
        if len(self.watching):
            self._consumed_notes(self.watching.expired(now), ConsumeStatus.LOST,
                                 f"no SEND_CONSUMED_ACK within the deadline and {GRACE:.0f}s; "
                                 "the message is stored, its consumption is not known")
        for item in expired:
            self._finish(
                item, Status.OUT_OF_RETRY,
                f"no reply after {item.attempts} writes ({self.config.resend_tries} resends, "
                f"{self.config.resend_interval}s apart); the message may or may not be stored",
            )
        by_conn: dict[ServerConnection, list[PendingSend]] = defaultdict(list)
        for item in resend:
            conn = self.pool.pick(item.message.topic)
            if conn is None:
                log.debug("resend %d of %r: no usable server", item.resends, item)
                continue
            item.server = conn.name
            by_conn[conn].append(item)
        for conn, items in by_conn.items():
            log.info("resending %d messages to %s", len(items), conn.name)
            self._write_resends(conn, items)

    def _write_resends(self, conn: ServerConnection, items: list[PendingSend]) -> bool:
        try:
            conn.write(b"".join([self._frame(i, Command.UP_PRODUCER_RESEND) for i in items]))
            return True
        except ConnectionUnavailable as exc:
            log.info("resend failed: %s", exc)
            return False

    # -- failover -----------------------------------------------------------------
    def connection_lost(self, conn: ServerConnection) -> None:
        """Fail over the sends that were waiting for ``conn``'s replies."""
        items = self.resends.on_server(conn.name)
        if items:
            self._fail_over(conn, items)
        if len(self.watching):
            self._consumed_notes(self.watching.on_server(conn.name), ConsumeStatus.LOST,
                                 f"the connection to {conn.name}, which watched it, was lost; "
                                 "the message is stored, its consumption is not known")

    def _fail_over(self, failed: ServerConnection, items: Iterable[PendingSend]) -> None:
        now = self.clock()
        by_conn: dict[ServerConnection, list[PendingSend]] = defaultdict(list)
        for item in items:
            other = self.pool.pick(item.message.topic, exclude=(failed.name,))
            if other is None:
                continue  # the resend runner retries it on schedule
            self.resends.rewritten(item, other.name, now)
            by_conn[other].append(item)
        for conn, moved in by_conn.items():
            log.info("failing over %d sends from %s to %s", len(moved), failed.name, conn.name)
            self._write_resends(conn, moved)

    # -- replies ------------------------------------------------------------------
    def replies(self, conn: ServerConnection, frames: list[Frame]) -> None:
        """SEND_* replies read by ``conn``'s reader thread."""
        answered: dict[tuple[str, int], Frame] = {}
        shutting: list[PendingSend] = []
        for frame in frames:
            # the server echoes the producer; a reply without one is for this client's own
            key = (frame.producer or self.producer_id, frame.session_id)
            if frame.command == Command.SEND_SERVER_ERROR and frame.status.startswith(_SHUTTING_DOWN):
                conn.mark_rebooting()
                item = self.resends.get(key)
                if item is not None:
                    shutting.append(item)
                continue
            answered[key] = frame
        if shutting:
            self._fail_over(conn, shutting)
        if not answered:
            return
        done: list[PendingSend] = []
        for item in self.resends.pop_many(answered):
            frame = answered[item.key]
            status = REPLY_STATUS[frame.command]
            if status is Status.SERVER_ERROR and frame.status.startswith("E_STORAGE"):
                conn.mark_unhealthy(frame.status)
            done += self._settle(
                item,
                status,
                frame.status if status is not Status.SUCCESS else "",
                message_id=frame.message_id if status is Status.SUCCESS else None,
                server=conn.name,
                duplicate=status is Status.SUCCESS and frame.status == "duplicate",
            )
        if done:
            for item in done:
                if isinstance(item, ConfirmingSend) and item.result is not None and item.result.ok:
                    # the server watches it now: SEND_CONSUMED_ACK follows on this connection
                    self.watching.add(item, conn.name, self.clock() + item.confirm_ms / 1000.0 + GRACE)
            self.notify.put_many(done)

    def consumed(self, frames: list[Frame]) -> None:
        """SEND_CONSUMED_ACK frames read by a reader thread: each outcome to its send's
        ``consumed`` future and callback, after the send's own result (one notify runner)."""
        notes = []
        for frame in frames:
            report = parse_consumed(frame.status)
            for item in self.watching.pop((frame.producer or self.producer_id, frame.session_id)):
                notes.append(ConsumedNote(item, Consumed.from_report(report, frame.topic, frame.session_id,
                                                                     frame.message_id)))
        if notes:
            self.notify.put_many(notes)

    def _consumed_notes(self, items: list[ConfirmingSend], status: ConsumeStatus, why: str) -> None:
        if items:
            self.notify.put_many([item.outcome(status, why) for item in items])

    # -- closing ------------------------------------------------------------------
    def close(self, timeout: float) -> None:
        """Stop accepting; wait up to ``timeout`` for every result; report the
        rest CLIENT_CLOSED; stop the send and resend runners. The notify runner
        keeps going until ``stop_notify`` (results produced later, e.g. by a
        handler sending during close, are delivered too)."""
        self._closing = True
        self.queue.close()
        if threading.current_thread() is self.notify.thread:
            timeout = 0  # called from a callback: results wait behind this very call
        self.wait_idle(timeout)
        self._stop.set()
        self._abort(self._close_pen(), "the client closed before the message was stored")
        # before the connections close: those confirmations end with the client, not a lost connection
        self._consumed_notes(self.watching.drain(), ConsumeStatus.CLIENT_CLOSED,
                             "the client closed before the server reported the message's consumption")
        self.pool.close()
        self._abort(self.resends.drain(), "the client closed before the server answered; "
                    "the message may or may not be stored")
        if threading.current_thread() is not self._send_thread:
            self._send_thread.join(max(timeout, self.config.write_timeout) + 1)
        self._abort(self.queue.drain(), "the client closed before the message was written")
        self._abort(self.resends.drain(), "the client closed before the server answered; "
                    "the message may or may not be stored")
        if threading.current_thread() is not self._resend_thread:
            self._resend_thread.join(5)

    def stop_notify(self, timeout: float) -> bool:
        """Deliver every queued result, then end the notify runner."""
        return self.notify.stop(timeout)

    def release_queue(self) -> None:
        """Close the files of a journal this producer opened (after the last result)."""
        shutdown = getattr(self.queue, "shutdown", None)
        if self._owns_queue and shutdown is not None:
            shutdown()

    def _abort(self, items: list[PendingSend], why: str) -> None:
        for item in items:
            self._finish(item, Status.CLIENT_CLOSED, why + self._kept)

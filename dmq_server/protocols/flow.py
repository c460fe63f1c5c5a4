"""Flow control on the TCP ports: stop reading a connection before memory grows.

Memory a connection can make the server hold comes from three places, and each is
capped here (the options are in ``dmq_server/core/options.py``):

* **replies the client does not read.** Each connection's ``ReadGate`` registers
  with its transport as a streaming producer; the transport pauses it when its
  write buffer passes ``--max-output-buffer`` (the high-water mark) and resumes it
  once the buffer has drained (the low-water mark: empty). While paused the
  server reads nothing more from that client, so a producer that pipelines sends
  without reading their answers is held by TCP, not by the server's memory.
* **sends awaiting their commit.** A connection may have at most
  ``--max-pending-sends`` sends, holding at most ``--max-pending-bytes`` of
  bodies, handed to the broker and not yet answered; past either it is not read
  until answers come back.
* **incomplete frames.** Every connection's partial frame and pending send bodies
  count against ``--max-buffered-bytes`` for the whole port (a ``BufferBudget``).
  Over it, a connection holding a 256th of the cap (or an eighth over it, one read's
  worth: ``client_memory.over_budget_stops``) is not read again until the total is
  back under three quarters of the cap; a small producer whose frame a read split is
  still served. An incomplete frame must be completed
  within ``--read-timeout`` (the timer runs from the frame's first byte), so
  connections trickling bytes cannot keep that memory forever.
* **everything, in bytes.** The same bytes, and the unsent replies and pushes in the
  transports' buffers, count against the server's one ``--max-client-memory``
  (``core.client_memory.ClientMemory``, which the channels' memory windows share). Over it, a
  connection holding many bytes of its own (``ClientMemory.should_stop``) is not read
  (``MEMORY``) until the total is under three quarters; the episode is logged once when it starts and once when it
  ends. A connection whose unsent bytes passed ``--max-output-buffer`` gets no more
  pushes until they are sent (``pushes_blocked``; its handler's ``output_blocked``
  hears the change), so a consumer that does not read is not written to without end.
  ``MemoryWatch`` refreshes the unsent counts each second (they only shrink between
  writes) and hands freed memory back to the operating system after large frees.

One read can still deliver up to 64 KiB (Twisted's read size) before a gate
closes; the bounds below are therefore "cap + one read" per connection. Time comes
from the injected clock (``IReactorTime``), so the timeouts are tested without
sleeping.

This module does not know the protocols: a handler tells its gate how many bytes
it holds (``input_held``), when a send starts and ends, and asks whether it is
paused for a reason of the server's own (``server_paused``; then a silent peer is
not the peer's fault).

Why one long module: a connection's gate, the port's budget and the watch over the
server's client memory act on the same few fields (a gate's reasons and the bytes it
holds); split, one pause would be decided in three files.
"""

from __future__ import annotations

import select
from typing import Any, Callable, cast

from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from zope.interface import implementer

from dmq_server.core import client_memory as kinds
from dmq_server.core.client_memory import ClientMemory, release_to_os
from dmq_server.core.clock import Clock
from dmq_server.core.options import Options

__all__ = [
    "BufferBudget", "FlowLimits", "ReadGate", "NoGate", "NO_GATE", "MemoryWatch",
    "OUTPUT", "PENDING", "BUDGET", "AUTH", "MEMORY",
]

log = Logger()

#: why a connection is not being read (AUTH: its handler waits for the authorizer;
#: MEMORY: the server's --max-client-memory)
OUTPUT, PENDING, BUDGET, AUTH, MEMORY = "output", "pending", "budget", "auth", "memory"


class FlowLimits:
    """The numbers a gate works with (from ``Options``, or the defaults)."""

    def __init__(
        self,
        max_output_buffer: int = 65536,
        max_pending_sends: int = 10000,
        max_pending_bytes: int = 8 * 1024 * 1024,
        max_buffered_bytes: int = 64 * 1024 * 1024,
        read_timeout: float = 30.0,
        max_client_memory: int = 256 * 1024 * 1024,
    ):
        self.max_output_buffer = max_output_buffer
        self.max_pending_sends = max_pending_sends
        self.max_pending_bytes = max_pending_bytes
        self.max_buffered_bytes = max_buffered_bytes
        self.read_timeout = read_timeout
        self.max_client_memory = max_client_memory

    @classmethod
    def from_options(cls, options: Options) -> "FlowLimits":
        defaults = cls()
        return cls(
            **{name: getattr(options, name, getattr(defaults, name)) for name in vars(defaults)}
        )


class BufferBudget:
    """Bytes held by all connections of one port (incomplete frames, pending send
    bodies), and the gates waiting for the total to fall; ``memory``, the server's
    budget of every byte held for clients, which these count against too."""

    def __init__(self, limit: int, memory: ClientMemory | None = None, read_size: int = kinds.READ_SIZE):
        self.memory = memory if memory is not None else ClientMemory(max(limit * 4, 256 * 1024 * 1024), read_size)
        self.limit = limit
        self.resume_below = limit * 3 // 4
        self.read_size = read_size
        self.large = max(read_size, limit // 256)
        self.hard_limit = limit + limit // 8
        self.held = 0
        self.peak = 0
        self.gates: set["ReadGate"] = set()
        self._waiting: dict["ReadGate", None] = {}

    @property
    def over(self) -> bool:
        return self.held > self.limit

    def should_stop(self, own: int) -> bool:
        """Whether a connection holding ``own`` bytes of frames and pending bodies is not
        to be read while the port holds what it holds (the server budget's rule)."""
        return kinds.over_budget_stops(own, self.held, self.limit, self.large, self.hard_limit, self.read_size)

    def count(self, kind: str, delta: int) -> None:
        """``delta`` bytes of ``kind`` (FRAMES or PENDING) more or fewer: counted here and
        in the server's ``memory`` in one call (the hot path of every send and read)."""
        if not delta:
            return
        held = self.held = self.held + delta
        if held > self.peak:
            self.peak = held
        if delta < 0 and self._waiting and held <= self.resume_below:
            self._release()
        self.memory.add(kind, delta)

    def _release(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for gate in waiting:
            gate.release(BUDGET)

    def wait(self, gate: "ReadGate") -> None:
        self._waiting[gate] = None

    def forget(self, gate: "ReadGate") -> None:
        self._waiting.pop(gate, None)
        self.gates.discard(gate)

    def stats(self) -> dict[str, Any]:
        gates = sorted(self.gates, key=lambda g: g.peer)
        return {
            "held_bytes": self.held,
            "peak_held_bytes": self.peak,
            "max_buffered_bytes": self.limit,
            "client_memory": self.memory.stats(),
            "connections": len(gates),
            "paused": sum(1 for g in gates if g.paused),
            "gates": [g.stats() for g in gates],
        }


@implementer(IPushProducer)
class ReadGate:
    """Decides whether one connection is read. The transport calls
    ``pauseProducing``/``resumeProducing`` (its write buffer); the handler reports
    what it holds; ``on_timeout(description)`` is called when an incomplete frame
    took longer than the read timeout (the description has no error code)."""

    def __init__(
        self,
        transport: Any,
        clock: Clock,
        limits: FlowLimits,
        budget: BufferBudget,
        on_timeout: Callable[[str], None],
        peer: str = "?",
    ):
        self.transport = transport
        self.clock = clock
        self.limits = limits
        self.budget = budget
        self.on_timeout = on_timeout
        self.peer = peer
        self.reasons: set[str] = set()
        self.pending_sends = 0
        self.pending_bytes = 0
        self.input_bytes = 0  # the handler's incomplete frame
        self.output_bytes = 0  # unsent, as last seen (ClientMemory's OUTPUT)
        self.memory = budget.memory
        self.on_output: Callable[[bool], None] | None = None  # the handler hears pushes_blocked change
        self.bytes_read = 0
        self.pauses = 0
        self.closed = False
        self.on_resume: Callable[[], None] | None = None  # the handler drains what it kept
        self._timer: Any = None
        self._abort: Any = None
        budget.gates.add(self)
        # the write buffer's high-water mark (Twisted also reads at most this much at once)
        transport.bufferSize = limits.max_output_buffer
        register = getattr(transport, "registerProducer", None)
        if register is not None:
            register(self, True)

    # -- what the handler reports --------------------------------------------------
    @property
    def paused(self) -> bool:
        return bool(self.reasons)

    @property
    def server_paused(self) -> bool:
        """Not read for a reason of the server's (commits, the port's budget, the
        server's memory): the client cannot be blamed for silence meanwhile."""
        reasons = self.reasons
        return PENDING in reasons or BUDGET in reasons or AUTH in reasons or MEMORY in reasons

    @property
    def pushes_blocked(self) -> bool:
        """The client has not read what was written to it (over ``--max-output-buffer``):
        no more pushes until it has."""
        return OUTPUT in self.reasons

    @property
    def held(self) -> int:
        return self.input_bytes + self.pending_bytes

    def received(self, count: int) -> None:
        self.bytes_read += count

    def input_held(self, count: int) -> None:
        """After the handler consumed what it could: ``count`` bytes of an incomplete
        frame remain buffered."""
        if self.closed:
            return
        if count != self.input_bytes:
            self.budget.count(kinds.FRAMES, count - self.input_bytes)
            self.input_bytes = count
        if count or self._timer is not None:
            self._arm_timer()  # (nothing to arm or cancel otherwise)
        if count:
            budget = self.budget
            if budget.held > budget.limit and budget.should_stop(self.input_bytes + self.pending_bytes):
                self.hold(BUDGET)
                budget.wait(self)
            memory = self.memory
            if memory.total > memory.limit:
                self._stop_for_memory()

    def _stop_for_memory(self) -> None:
        """Over the server's budget (``ClientMemory.should_stop``, by the bytes this
        connection holds): not read until the total is under the resume mark."""
        if (
            not self.closed
            and MEMORY not in self.reasons
            and self.memory.should_stop(self.input_bytes + self.pending_bytes + self.output_bytes)
        ):
            self.hold(MEMORY)
            self.memory.stop(self, self._memory_resumed)

    def _memory_resumed(self) -> None:
        self.release(MEMORY)

    def let_close(self) -> None:
        """The peer closed its side while the port was not reading it for memory (the
        budgets): read it again, so the rest it sent (at most a socket buffer) and its
        end are read and the connection, with what it holds, goes."""
        held = self.reasons & {MEMORY, BUDGET}
        if not held or self.closed:
            return
        self.reasons -= held
        self.memory.forget(self)
        self.budget.forget(self)
        self.budget.gates.add(self)
        if not self.reasons:
            self.transport.resumeProducing()

    def output_queued(self) -> None:
        """The handler's write left bytes in the transport's buffer (or the watch looks
        again): count what is unsent now."""
        if self.closed:
            return
        now = output_buffered(self.transport)
        delta = now - self.output_bytes
        if delta:
            self.output_bytes = now
            self.memory.add(kinds.OUTPUT, delta)
            if delta > 0 and self.memory.over:
                self._stop_for_memory()

    def sends_started(self, count: int, size: int) -> None:
        """``count`` sends of ``size`` bytes in all were read and wait for their answers."""
        sends = self.pending_sends = self.pending_sends + count
        pending = self.pending_bytes = self.pending_bytes + size
        budget, memory = self.budget, self.memory
        budget.count(kinds.PENDING, size)
        if memory.total > memory.limit:
            self._stop_for_memory()
        limits = self.limits
        if sends >= limits.max_pending_sends or pending >= limits.max_pending_bytes:
            self.hold(PENDING)
        if budget.held > budget.limit and budget.should_stop(self.input_bytes + pending):
            self.hold(BUDGET)
            budget.wait(self)

    def sends_done(self, count: int, size: int) -> None:
        """``count`` of them, ``size`` bytes in all, were answered."""
        self.pending_sends -= count
        self.pending_bytes -= size
        self.budget.count(kinds.PENDING, -size)
        if (
            PENDING in self.reasons
            and self.pending_sends <= self.limits.max_pending_sends // 2
            and self.pending_bytes <= self.limits.max_pending_bytes // 2
        ):
            self.release(PENDING)

    # -- pausing ---------------------------------------------------------------------
    def hold(self, reason: str) -> None:
        if self.closed or reason in self.reasons:
            return
        if not self.reasons:
            self.pauses += 1
            self.transport.pauseProducing()
        self.reasons.add(reason)
        self._arm_timer()

    def release(self, reason: str) -> None:
        if reason not in self.reasons:
            return
        self.reasons.discard(reason)
        if self.closed:
            return
        if not self.reasons and self.on_resume is not None:
            self.on_resume()  # may hold again (e.g. inflated input it had kept)
        if not self.reasons and not self.closed:
            self.transport.resumeProducing()
        self._arm_timer()

    # IPushProducer: the transport's write buffer
    def pauseProducing(self) -> None:
        blocked = OUTPUT in self.reasons
        self.hold(OUTPUT)
        self.output_queued()
        if not blocked and self.on_output is not None and not self.closed:
            self.on_output(True)

    def resumeProducing(self) -> None:
        if getattr(self.transport, "disconnecting", False):
            # a registered producer keeps a closing transport open: let it go
            self.transport.unregisterProducer()
            return
        blocked = OUTPUT in self.reasons
        self.output_queued()  # drained: nothing unsent
        self.release(OUTPUT)
        if blocked and self.on_output is not None and not self.closed:
            self.on_output(False)

    def stopProducing(self) -> None:
        self.close()

    # -- the read timeout for incomplete frames -------------------------------------
    def _arm_timer(self) -> None:
        """Runs while an incomplete frame is buffered and the server is willing to read
        it (a pause for the client's unread replies or the server's commits stops it;
        a pause for the port's budget does not, or trickling peers could hold the
        budget for ever)."""
        want = (
            self.input_bytes > 0
            and not self.closed
            and self.limits.read_timeout > 0
            and OUTPUT not in self.reasons
            and PENDING not in self.reasons
        )
        if want and self._timer is None:
            self._timer = self.clock.callLater(self.limits.read_timeout, self._timed_out)
        elif not want and self._timer is not None:
            if self._timer.active():
                self._timer.cancel()
            self._timer = None

    def closing(self) -> None:
        """The handler closed the connection. Twisted closes a TCP connection only once its
        unsent bytes are sent; a client that reads nothing would keep it (and them) for
        ever, so it is aborted if still there after the read timeout (30 s if disabled)."""
        if self._abort is None and not self.closed:
            delay = self.limits.read_timeout or 30.0
            self._abort = self.clock.callLater(delay, self._abort_now)

    def _abort_now(self) -> None:
        self._abort = None
        if not self.closed:
            abort = getattr(self.transport, "abortConnection", None)
            if abort is not None:
                abort()

    def frame_completed(self) -> None:
        """A whole frame arrived: the timer starts again for the next one."""
        if self._timer is not None:
            if self._timer.active():
                self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self.closed or self.input_bytes == 0:
            return
        self.on_timeout(
            f"incomplete frame ({self.input_bytes} bytes) not finished within {self.limits.read_timeout:g}s"
        )

    # -- end -------------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for timer in (self._timer, self._abort):
            if timer is not None and timer.active():
                timer.cancel()
        self._timer = self._abort = None
        # the bodies of sends still awaiting their commit stay counted until answered
        self.budget.count(kinds.FRAMES, -self.input_bytes)
        self.memory.add(kinds.OUTPUT, -self.output_bytes)
        self.input_bytes = self.output_bytes = 0
        self.budget.forget(self)
        self.memory.forget(self)
        self.on_output = None

    def stats(self) -> dict[str, Any]:
        return {
            "peer": self.peer,
            "paused": sorted(self.reasons),
            "held_bytes": self.held,
            "incomplete_frame_bytes": self.input_bytes,
            "pending_sends": self.pending_sends,
            "pending_bytes": self.pending_bytes,
            "output_buffer_bytes": output_buffered(self.transport),
            "bytes_read": self.bytes_read,
            "pauses": self.pauses,
        }


class NoGate:
    """A handler's gate when nothing limits it (unit tests that drive a handler alone)."""

    paused = server_paused = pushes_blocked = False

    def output_queued(self) -> None:
        pass

    def sends_started(self, count: int, size: int) -> None:
        pass

    def sends_done(self, count: int, size: int) -> None:
        pass

    def frame_completed(self) -> None:
        pass

    def closing(self) -> None:
        pass

    def hold(self, reason: str) -> None:
        pass

    def release(self, reason: str) -> None:
        pass


NO_GATE = NoGate()


_HUNG_UP = getattr(select, "POLLRDHUP", 0x2000) | select.POLLHUP | select.POLLERR


def peer_closed(transport: Any) -> bool:
    """Whether the peer closed (or reset) a connection the port is not reading: a paused
    transport does not see the end of its stream, so a client gone while stopped would
    keep what it holds until a timeout. False where there is no socket to ask."""
    try:
        fd = transport.fileno()
    except (AttributeError, ValueError, OSError):
        return False
    if not isinstance(fd, int) or fd < 0:
        return False
    poller = select.poll()
    poller.register(fd, _HUNG_UP)
    return bool(poller.poll(0))


def output_buffered(transport: Any) -> int:
    """Bytes the transport has not sent yet (Twisted keeps them in two buffers)."""
    try:
        return len(transport.dataBuffer) - transport.offset + transport._tempDataLen
    except AttributeError:
        return 0


class MemoryWatch:
    """The ``ClientMemory`` adapter on the reactor: logs each episode over the budget
    once when it starts and once when it ends; every ``interval`` seconds looks at the
    connections' unsent bytes again (written bytes leave Twisted's buffer without a
    word to the gate) and, once enough was freed (``ClientMemory.trim_due``), hands it
    back to the operating system (``core.client_memory.release_to_os``)."""

    def __init__(self, memory: ClientMemory, budget: BufferBudget | None, clock: Clock, interval: float = 1.0):
        self.memory = memory
        self.budget = budget
        memory.on_episode = self._episode
        self._loop = LoopingCall(self.tick)
        # IReactorTime is a zope interface, nominal to mypy; the reactor and task.Clock provide it
        self._loop.clock = cast(IReactorTime, clock)
        self.interval = interval

    def start(self) -> None:
        if not self._loop.running:
            self._loop.start(self.interval, now=False)

    def stop(self) -> None:
        if self._loop.running:
            self._loop.stop()

    def tick(self) -> None:
        if self.budget is not None:
            for gate in list(self.budget.gates):
                gate.output_queued()
                if (MEMORY in gate.reasons or BUDGET in gate.reasons) and peer_closed(gate.transport):
                    gate.let_close()
        if self.memory.trim_due() and release_to_os():
            self.memory.trims += 1

    def _episode(self, started: bool) -> None:
        memory = self.memory
        held = ", ".join(f"{kind} {size}" for kind, size in memory.held.items() if size)
        if started:
            log.warn(
                "client memory over its budget: {total} of {limit} bytes held ({held}); connections "
                "holding frames or sends are not read until it is under {resume}",
                total=memory.total, limit=memory.limit, held=held or "nothing", resume=memory.resume_below,
            )
        else:
            log.info(
                "client memory back under its budget: {total} of {limit} bytes held; reading again",
                total=memory.total, limit=memory.limit,
            )

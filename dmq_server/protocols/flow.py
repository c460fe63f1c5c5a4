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
  Over it, a connection that holds anything is not read again until the total is
  back under three quarters of the cap. An incomplete frame must be completed
  within ``--read-timeout`` (the timer runs from the frame's first byte), so
  connections trickling bytes cannot keep that memory forever.

One read can still deliver up to 64 KiB (Twisted's read size) before a gate
closes; the bounds below are therefore "cap + one read" per connection. Time comes
from the injected clock (``IReactorTime``), so the timeouts are tested without
sleeping.

This module does not know the protocols: a handler tells its gate how many bytes
it holds (``input_held``), when a send starts and ends, and asks whether it is
paused for a reason of the server's own (``server_paused``; then a silent peer is
not the peer's fault).
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.internet.interfaces import IPushProducer
from zope.interface import implementer

__all__ = ["BufferBudget", "FlowLimits", "ReadGate", "NoGate", "NO_GATE", "OUTPUT", "PENDING", "BUDGET", "AUTH"]

#: why a connection is not being read (AUTH: its handler waits for the authorizer)
OUTPUT, PENDING, BUDGET, AUTH = "output", "pending", "budget", "auth"


class FlowLimits:
    """The numbers a gate works with (from ``Options``, or the defaults)."""

    def __init__(
        self,
        max_output_buffer: int = 65536,
        max_pending_sends: int = 10000,
        max_pending_bytes: int = 8 * 1024 * 1024,
        max_buffered_bytes: int = 64 * 1024 * 1024,
        read_timeout: float = 30.0,
    ):
        self.max_output_buffer = max_output_buffer
        self.max_pending_sends = max_pending_sends
        self.max_pending_bytes = max_pending_bytes
        self.max_buffered_bytes = max_buffered_bytes
        self.read_timeout = read_timeout

    @classmethod
    def from_options(cls, options: Any) -> "FlowLimits":
        defaults = cls()
        return cls(
            **{name: getattr(options, name, getattr(defaults, name)) for name in vars(defaults)}
        )


class BufferBudget:
    """Bytes held by all connections of one port (incomplete frames, pending send
    bodies), and the gates waiting for the total to fall."""

    def __init__(self, limit: int):
        self.limit = limit
        self.resume_below = limit * 3 // 4
        self.held = 0
        self.peak = 0
        self.gates: set["ReadGate"] = set()
        self._waiting: dict["ReadGate", None] = {}

    @property
    def over(self) -> bool:
        return self.held > self.limit

    def change(self, delta: int) -> None:
        self.held += delta
        if self.held > self.peak:
            self.peak = self.held
        if delta < 0 and self._waiting and self.held <= self.resume_below:
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
        clock: Any,
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
        """Not read for a reason of the server's (commits, the port's budget): the
        client cannot be blamed for silence or a slow frame meanwhile."""
        return PENDING in self.reasons or BUDGET in self.reasons or AUTH in self.reasons

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
        self.budget.change(count - self.input_bytes)
        self.input_bytes = count
        self._arm_timer()
        if count and self.budget.over:
            self.hold(BUDGET)
            self.budget.wait(self)

    def sends_started(self, count: int, size: int) -> None:
        """``count`` sends of ``size`` bytes in all were read and wait for their answers."""
        self.pending_sends += count
        self.pending_bytes += size
        self.budget.change(size)
        limits = self.limits
        if self.pending_sends >= limits.max_pending_sends or self.pending_bytes >= limits.max_pending_bytes:
            self.hold(PENDING)
        if self.budget.over:
            self.hold(BUDGET)
            self.budget.wait(self)

    def sends_done(self, count: int, size: int) -> None:
        """``count`` of them, ``size`` bytes in all, were answered."""
        self.pending_sends -= count
        self.pending_bytes -= size
        self.budget.change(-size)
        limits = self.limits
        if (
            PENDING in self.reasons
            and self.pending_sends <= limits.max_pending_sends // 2
            and self.pending_bytes <= limits.max_pending_bytes // 2
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
        self.hold(OUTPUT)

    def resumeProducing(self) -> None:
        if getattr(self.transport, "disconnecting", False):
            # a registered producer keeps a closing transport open: let it go
            self.transport.unregisterProducer()
            return
        self.release(OUTPUT)

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
        self.budget.change(-self.input_bytes)
        self.input_bytes = 0
        self.budget.forget(self)

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

    paused = server_paused = False

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


def output_buffered(transport: Any) -> int:
    """Bytes the transport has not sent yet (Twisted keeps them in two buffers)."""
    try:
        return len(transport.dataBuffer) - transport.offset + transport._tempDataLen
    except AttributeError:
        return 0

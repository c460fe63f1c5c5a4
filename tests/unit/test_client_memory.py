"""``core.client_memory.ClientMemory`` and the gates and windows that count against it (no IO:
string transports, an injected clock, the fast store's windows over in-memory backends)."""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from dmq_server.core.client_memory import FAST_WINDOW, FRAMES, OUTPUT, PENDING, ClientMemory, WindowBytes
from dmq_server.protocols.flow import MEMORY, BufferBudget, FlowLimits, MemoryWatch, ReadGate

MB = 1024 * 1024


def gate(memory: ClientMemory, transport=None) -> ReadGate:
    limits = FlowLimits(max_pending_bytes=10**12)
    return ReadGate(transport or StringTransport(), Clock(), limits, BufferBudget(10**12, memory), lambda why: None)


def test_bytes_are_counted_by_kind_and_the_peak_kept():
    """Every kind adds to one total; the peak stays when the bytes go."""
    memory = ClientMemory(64 * MB)
    memory.add(FRAMES, 5 * MB)
    memory.add(PENDING, 3 * MB)
    memory.add(FRAMES, -5 * MB)
    assert memory.held[FRAMES] == 0 and memory.held[PENDING] == 3 * MB
    assert memory.total == 3 * MB and memory.peak == 8 * MB


def test_over_the_limit_only_connections_holding_much_stop_until_the_hard_mark():
    """A connection holding a 256th of the budget stops when the total is over it; a
    smaller one goes on until the total passes the limit by an eighth, and then only one
    holding at least a read's worth stops: one holding less (a small producer whose frame
    a read split) is never stopped."""
    memory = ClientMemory(64 * MB)
    assert memory.large == 256 * 1024 and memory.hard_limit == 72 * MB and memory.read_size == 65536
    memory.add(FRAMES, 65 * MB)
    assert memory.should_stop(memory.large) and not memory.should_stop(65536) and not memory.should_stop(0)
    memory.add(FRAMES, 8 * MB)
    assert memory.should_stop(65536) and memory.should_stop(memory.large)
    assert not memory.should_stop(65535) and not memory.should_stop(1000) and not memory.should_stop(0)
    memory.add(FRAMES, -73 * MB + 10)
    assert not memory.should_stop(memory.large)
    assert ClientMemory(64 * MB, read_size=4096).large == 256 * 1024  # a 256th when larger
    assert ClientMemory(MB, read_size=4096).large == 4096  # else a read


def test_stopped_gates_resume_under_three_quarters_and_the_episode_is_told_once():
    """Two producers pass the budget: each is stopped (one pause each, one episode); they
    are read again once the total falls under three quarters, and the episode ends then."""
    memory = ClientMemory(16 * MB)
    told: list[bool] = []
    memory.on_episode = told.append
    a, b = gate(memory), gate(memory)
    a.sends_started(1, 9 * MB)
    assert not a.paused
    b.input_held(8 * MB)
    a.input_held(1)  # a read more: still over
    assert MEMORY in a.reasons and MEMORY in b.reasons
    assert a.transport.producerState == "paused" and b.transport.producerState == "paused"
    assert memory.pauses == 2 and memory.episodes == 1 and told == [True] and memory.stopped == 2
    a.sends_done(1, 9 * MB)  # 8 MB + 1 left: at most three quarters of 16
    assert not a.paused and not b.paused and told == [True, False] and memory.stopped == 0
    assert a.transport.producerState == "producing"


def test_a_small_producer_is_read_while_the_large_ones_wait():
    memory = ClientMemory(16 * MB)
    large, small = gate(memory), gate(memory)
    large.input_held(17 * MB)
    small.sends_started(1, 100)
    assert MEMORY in large.reasons and not small.paused


def test_unsent_output_is_counted_and_blocks_pushes_until_drained():
    """The transport's unsent bytes count as output; over --max-output-buffer the gate is
    paused by the transport and the handler hears that pushes stop, then that they may go."""
    memory = ClientMemory(64 * MB)
    transport = StringTransport()
    g = gate(memory, transport)
    heard: list[bool] = []
    g.on_output = heard.append
    transport.dataBuffer, transport.offset, transport._tempDataLen = b"x" * 100_000, 0, 0
    g.pauseProducing()
    assert g.pushes_blocked and memory.held[OUTPUT] == 100_000 and heard == [True]
    transport.dataBuffer = b""
    g.resumeProducing()
    assert not g.pushes_blocked and memory.held[OUTPUT] == 0 and heard == [True, False]


def test_a_closed_gate_gives_back_its_frame_and_output_bytes():
    memory = ClientMemory(64 * MB)
    g = gate(memory)
    g.input_held(3 * MB)
    g.close()
    assert memory.total == 0 and memory.held[FRAMES] == 0


def test_windows_get_a_sixteenth_each_half_in_all_and_never_past_the_limit():
    memory = ClientMemory(64 * MB)
    assert memory.channel_limit == 4 * MB and memory.window_limit == 32 * MB
    window = WindowBytes(memory, FAST_WINDOW)
    assert window.fits(4 * MB) and not window.fits(4 * MB + 1)
    assert window.bytes_left() == 4 * MB  # what a batch counts its messages against
    window.add(3 * MB)
    assert not window.fits(2 * MB) and window.fits(1 * MB)
    assert window.bytes_left() == 1 * MB  # the channel's sixteenth
    others = [WindowBytes(memory, FAST_WINDOW) for _ in range(10)]
    for other in others[:9]:
        other.add(3 * MB)
    assert memory.windows == 30 * MB and not others[9].fits(3 * MB)  # the windows' half is spent
    assert others[9].bytes_left() == 2 * MB
    memory.add(PENDING, 33 * MB)
    assert not others[9].fits(1 * MB + 1)  # the total would pass the limit
    assert others[9].bytes_left() == 1 * MB
    window.clear()
    assert window.held == 0 and memory.windows == 27 * MB
    assert WindowBytes(None, FAST_WINDOW).fits(10**12)
    assert WindowBytes(None, FAST_WINDOW).bytes_left() >= 10**12


def test_a_trim_is_due_after_a_sixteenth_of_the_budget_was_freed():
    """Returning memory to the OS is worth it after large frees, not after every small one;
    the watch makes the call on its tick (counted)."""
    memory = ClientMemory(64 * MB)
    memory.add(FRAMES, 10 * MB)
    memory.add(FRAMES, -3 * MB)
    assert not memory.trim_due()
    memory.add(FRAMES, -1 * MB)
    assert memory.trim_due() and not memory.trim_due()
    clock = Clock()
    watch = MemoryWatch(memory, None, clock)
    watch.start()
    memory.add(FRAMES, -6 * MB)
    clock.advance(1)
    assert memory.trims == 1  # glibc here: malloc_trim was called
    watch.stop()


def test_the_watch_logs_nothing_itself_but_each_episode(capsys):
    """``on_episode`` is the watch's: the start and the end, once each."""
    from twisted.logger import LogLevel, globalLogPublisher

    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    try:
        memory = ClientMemory(16 * MB)
        MemoryWatch(memory, None, Clock())
        g = gate(memory)
        g.input_held(17 * MB)
        g.input_held(17 * MB + 10)
        g.input_held(0)
    finally:
        globalLogPublisher.removeObserver(events.append)
    texts = [e["log_format"] for e in events if "client memory" in e.get("log_format", "")]
    assert len(texts) == 2 and "over its budget" in texts[0] and "back under" in texts[1]
    assert [e["log_level"] for e in events if "client memory" in e.get("log_format", "")] == [LogLevel.warn, LogLevel.info]

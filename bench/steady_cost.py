"""dmq-server's CPU per message in the shape of ``bench/reliable.py``'s steady scenario,
without sockets or PostgreSQL: paced producers, each send in a read of its own.

At 5,000 msgs/s from four paced producers nearly every read holds one send, and a group
commit holds the ten or so that arrived while the one before it was in flight; the run
work of the full-load scenarios (a read's sends admitted together, a commit's answers
encoded together) then has runs of one. dmq-server's CPU a message in the steady
scenario is several times its full-load figure (docs/benchmarks.md, the targets table):
this is the path that figure is made of, in a form that counts instructions.

Four producer connections (real ``DmqConnection``s on string transports) send in turn,
one ``UP_PRODUCER_SEND`` a read, the reactor turn ended after each (``clock.advance(0)``:
the turn buffers write); after every ``--batch`` sends the stand-in group-commit
connection (``message_cost.StandInWriter``) answers the batch in flight, the next one
goes out with the sends queued meanwhile, and the clock moves by the time those sends
take at 5,000 msgs/s, so the server's timers run as often as in the scenario. The
channel has no consumer, as in the scenario (its copies wait in memory).

Not in the figure: the kernel's socket work and the reactor's own loop (its wake-up,
``recv`` and callback chain for each read, a writer registration and a ``send`` for each
reply), psycopg and PostgreSQL.

    python bench/steady_cost.py                            # this tree, CPU time, 5 rounds
    python bench/steady_cost.py --tree /tmp/old --tree . --instructions
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _cost as cost  # noqa: E402

BATCH = 10  # sends a group commit holds at 5,000 msgs/s (the scenario's 10-17)
PRODUCERS = 4
RATE = 5000.0
BODY = b"x" * 200


def child(messages: int, check: bool = False) -> dict:
    """Run in a fresh interpreter whose path starts with the tree under test. ``check``
    decodes each producer's answers (the unit test's run)."""
    import struct
    from operator import attrgetter

    from twisted.internet.task import Clock

    from dmq_client.wire import MAGIC, Command, Frame, FrameDecoder, encode
    from dmq_server.core.options import Options
    from dmq_server.db.memory import MemoryDb
    from message_cost import StandInWriter, serve

    class BenchClock(Clock):
        """``Clock`` with its calls ordered by a C-level key: ``advance`` sorts them every
        time, and Clock's own key (a lambda calling ``getTime``) was a fifth of this run's
        profile, work the reactor's heap of timers does not do."""

        def _sortCalls(self) -> None:
            self.calls.sort(key=attrgetter("time"))

    clock = BenchClock()
    clock.advance(1_700_000_000)
    options = Options(commit_writers=1)
    writer = StandInWriter(clock)
    factory, _ = serve(clock, options, MemoryDb, writer)
    producers = [cost.connect(factory, MAGIC, 50001 + i) for i in range(PRODUCERS)]
    for _, out in producers:
        out.clear()  # SERVER_HEALTH
    templates, offsets, sessions = [], [], [0] * PRODUCERS
    for i in range(PRODUCERS):
        one, two = (encode(Frame(Command.UP_PRODUCER_SEND, session_id=s, topic="orders", producer=f"p{i}",
                                 timestamp_ms=1_700_000_000_000, body=BODY)) for s in (1, 2))
        offsets.append(next(k for k in range(len(one)) if one[k] != two[k]) - 7)
        templates.append(bytearray(one))
    answered: list[list[int]] = [[] for _ in range(PRODUCERS)]

    def send(i: int) -> None:
        sessions[i] += 1
        struct.pack_into(">q", templates[i], offsets[i], sessions[i])
        producers[i][0].dataReceived(bytes(templates[i]))
        clock.advance(0)  # the read's turn ends

    def collect() -> None:
        for i, (_, out) in enumerate(producers):
            if check:
                for f in FrameDecoder().feed(out.value()):
                    if f.command != Command.SEND_SUCCESS_ACK:
                        raise AssertionError(f"producer {i}: {f.command.name} {f}")
                    answered[i].append(f.session_id)
            out.clear()

    send(0)  # one send first, so that every batch after it is the sends queued meanwhile
    step = BATCH / RATE
    batches = messages // BATCH + 1
    n = 0
    cpu = 0.0
    gc.disable()
    for b in range(batches):
        start = time.process_time()
        writer.release()  # the batch in flight commits; the sends queued meanwhile go out
        clock.advance(0)  # its answers are written
        if b < batches - 1:
            for _ in range(BATCH):
                send(n % PRODUCERS)
                n += 1
        clock.advance(step)  # the time those sends took to arrive: timers run as often
        cpu += time.process_time() - start
        collect()
    gc.enable()
    writer.release()  # the last batch, untimed
    clock.advance(0)
    collect()
    if check:
        got = [sorted(a) for a in answered]
        if got != [list(range(1, s + 1)) for s in sessions]:  # every send answered once, the last batch too
            raise AssertionError(f"answers {[len(g) for g in got]} for sessions {sessions}")
    return {"message_ns": cpu / max(1, n) * 1e9}


def main() -> None:
    cost.main("steady_cost", __doc__, "message (a send a read, commits of 10)", ("message_ns",), 2 * BATCH * 10,
              BATCH)


if __name__ == "__main__":
    main()

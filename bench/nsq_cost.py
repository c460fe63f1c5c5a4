"""dmq-server's CPU per message on the NSQ fast path, without sockets: what ``nsq.py``'s
end-to-end scenario costs the server, counted without the noise of a shared machine.

The real ``NsqConnection`` (on a string transport, as the unit tests run it), ``Broker``
and ``FastStore`` with its disk queues in a temporary directory: a producer connection
sends a round of ``PUB``s in one read and is answered ``OK`` each; a consumer connection
subscribed with ``RDY`` for two rounds receives each message and finishes the round's
messages with ``FIN``s in one read. Everything between the bytes in and the bytes out is
dmq's own code, timers included.

Not in the figure: the kernel's socket and file work (valgrind counts user space only).
In the figure, besides the server: building a round's frames and slicing the pushed ids
out of the consumer's bytes (a few hundred instructions a message, the same in every
tree).

Run ``python bench/nsq_cost.py`` for CPU time (5 rounds alternated between ``--tree``
builds), with ``--instructions`` for valgrind's count, e.g. ``--tree /tmp/old --tree .
--instructions``.
"""

from __future__ import annotations

import gc
import inspect
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cost import connect, main as cost_main  # noqa: E402

ROUND = 200
BODY = b"x" * 200
# a pushed message: size, frame type, timestamp, attempts, id, body
PUSH = 4 + 4 + 8 + 2 + 16 + len(BODY)


@contextmanager
def nsq_server(**options: object) -> Iterator[tuple]:
    """The NSQ path of one dmq-server on string transports: (clock, fast store, a
    function that connects a client). ``options`` override ``Options``' defaults."""
    from twisted.internet.task import Clock

    from dmq_server.broker.broker import Broker
    from dmq_server.core.options import Options
    from dmq_server.db.memory import MemoryDb
    try:
        from dmq_server.fast.fast_store import FastStore
    except ModuleNotFoundError:  # a tree from before the module's rename (issue 43), for --tree
        from dmq_server.fast.store import FastStore  # type: ignore[no-redef]
    from dmq_server.protocols.flow import FlowLimits
    from dmq_server.protocols.listener import NSQ_MAGIC, PortFactory
    from dmq_server.protocols.nsq_context import NsqContext
    from dmq_server.protocols.nsq_v2 import NsqConnection

    clock = Clock()
    clock.advance(1_700_000_000)
    config = Options(**options)
    with tempfile.TemporaryDirectory(prefix="nsq-cost-") as data:
        fast = FastStore.from_options(config, clock, Path(data))
        fast.start()
        db = MemoryDb(clock)
        roles = {"writer0": db, "acker": db, "loader": db, "admin": db}
        broker = Broker(config, clock, roles, "bench-node", fast=fast)
        started = broker.start()
        clock.advance(0)
        assert started.called
        fast.timers.startService()
        broker.timers.startService()
        if "store" in inspect.signature(NsqContext).parameters:  # a tree before issue 43's seam
            ctx = NsqContext(fast, broker, config, clock)
        else:
            ctx = NsqContext(broker, config, clock)
        factory = PortFactory(clock, {NSQ_MAGIC: lambda t: NsqConnection(t, ctx)}, FlowLimits())
        yield clock, fast, lambda port: connect(factory, NSQ_MAGIC, port)
        fast.timers.stopService()
        broker.timers.stopService()
        fast.close()


def child(messages: int, check: bool = False) -> dict:
    """Run in a fresh interpreter whose path starts with the tree under test. ``check``
    decodes the replies of each round (the unit test's run)."""
    import struct

    with nsq_server() as (clock, fast, connect_client):
        producer, produced = connect_client(50001)
        consumer, consumed = connect_client(50002)
        # the topic exists before the consumer subscribes (as nsq.py's first PUB makes it)
        producer.dataReceived(b"PUB events\n" + struct.pack(">I", len(BODY)) + BODY)
        consumer.dataReceived(b"SUB events c1\nRDY %d\n" % (2 * ROUND))
        clock.advance(0)
        first = consumed.value()[-PUSH:]  # after SUB's OK, that message
        consumer.dataReceived(b"FIN " + first[18:34] + b"\n")
        clock.advance(0)
        produced.clear()
        consumed.clear()
        pubs = (b"PUB events\n" + struct.pack(">I", len(BODY)) + BODY) * ROUND
        rounds = messages // ROUND
        publish_cpu = consume_cpu = 0.0
        gc.disable()  # the server runs with GC on, but its pauses would land in one half at random
        for n in range(rounds + 1):
            start = time.process_time()
            producer.dataReceived(pubs)
            clock.advance(0)  # the turn ends: OKs and pushes written
            published = time.process_time()
            pushed = consumed.value()
            consumed.clear()
            fins = b"".join(b"FIN " + pushed[i + 18:i + 34] + b"\n" for i in range(0, len(pushed), PUSH))
            finishing = time.process_time()
            consumer.dataReceived(fins)
            clock.advance(0)
            done = time.process_time()
            if n:  # the first round warms up
                publish_cpu += published - start
                consume_cpu += done - finishing
            if check:
                replies = produced.value()
                ok = struct.pack(">II", 6, 0) + b"OK"
                if replies != ok * ROUND:
                    raise AssertionError(f"round {n}: the producer got {replies[:60]!r}... not {ROUND} OKs")
                if len(pushed) != ROUND * PUSH or consumed.value():
                    raise AssertionError(f"round {n}: {len(pushed) / PUSH:g} messages pushed, not {ROUND}; "
                                         f"answered {consumed.value()[:60]!r}")
            produced.clear()
            consumed.clear()
        gc.enable()
        if check and fast.topics["events"].channels["c1"].in_flight:
            raise AssertionError("messages still in flight after every FIN")
    done_messages = rounds * ROUND
    return {"publish_ns": publish_cpu / max(1, done_messages) * 1e9,
            "consume_ns": consume_cpu / max(1, done_messages) * 1e9}


def main() -> None:
    cost_main("nsq_cost", __doc__, "message (PUB, push, FIN)", ("publish_ns", "consume_ns"), 2 * ROUND, ROUND)


if __name__ == "__main__":
    main()

"""dmq-server's CPU per message on the NSQ fast path when messages wait on disk: what
``nsq.py``'s ``pub`` and ``consume`` scenarios cost the server, counted without the noise
of a shared machine (``nsq_cost.py`` counts the end-to-end scenario, where nothing waits).

As in ``nsq.py``, the channel exists before anything is published and has no consumer: a
producer connection sends rounds of ``PUB``s, one read each, every one answered ``OK``;
the first ``--mem-queue-size`` messages wait in the channel's memory and the rest in its
disk queue (files in a temporary directory). Then a consumer subscribes with ``RDY 256``
and finishes every message it is pushed, a read of ``FIN``s at a time, until the channel
is empty. ``nsq.py`` runs 50,000 messages against a window of 10,000; here the window is
1,000, so that the few thousand messages ``--instructions`` can afford go to disk too
(the baseline run holds 1,000, the window; the counted extra all pass through the disk).

Not in the figure: the kernel's socket and file work (valgrind counts user space only).

    python bench/nsq_backlog_cost.py                          # CPU time, 5 rounds
    python bench/nsq_backlog_cost.py --tree /tmp/old --tree . --instructions
"""

from __future__ import annotations

import gc
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cost import main as cost_main  # noqa: E402
from nsq_cost import BODY, PUSH, nsq_server  # noqa: E402

ROUND = 200
WINDOW = 1000  # --mem-queue-size
RDY = 256


def child(messages: int, check: bool = False) -> dict:
    """Run in a fresh interpreter whose path starts with the tree under test. ``check``
    verifies the answers and that every message is pushed once (the unit test's run)."""
    with nsq_server(mem_queue_size=WINDOW) as (clock, fast, connect_client):
        fast.get_topic("backlog").get_channel("c1")
        producer, produced = connect_client(50001)
        pubs = (b"PUB backlog\n" + struct.pack(">I", len(BODY)) + BODY) * ROUND
        rounds = -(-messages // ROUND)
        gc.disable()  # the server runs with GC on, but its pauses would land in one half at random
        start = time.process_time()
        for _ in range(rounds):
            producer.dataReceived(pubs)
            clock.advance(0)  # the turn ends: the OKs and the disk queue's buffer written
            if check and produced.value() != (struct.pack(">II", 6, 0) + b"OK") * ROUND:
                raise AssertionError(f"the producer got {produced.value()[:60]!r}... not {ROUND} OKs")
            produced.clear()
        published = time.process_time()
        total = rounds * ROUND
        consumer, consumed = connect_client(50002)
        consumer.dataReceived(b"SUB backlog c1\nRDY %d\n" % RDY)
        clock.advance(0)
        pushed = consumed.value()[10:]  # after SUB's OK
        consumed.clear()
        seen: set[bytes] = set()
        got = 0
        while got < total:
            ids = [pushed[i + 18:i + 34] for i in range(0, len(pushed), PUSH)]
            if not ids:
                raise AssertionError(f"nothing more pushed after {got} of {total} messages")
            if check:
                seen.update(ids)
            got += len(ids)
            consumer.dataReceived(b"".join(b"FIN " + message_id + b"\n" for message_id in ids))
            clock.advance(0)
            pushed = consumed.value()
            consumed.clear()
        done = time.process_time()
        gc.enable()
        if check:
            channel = fast.topics["backlog"].channels["c1"]
            if len(seen) != total or got != total or channel.depth() or channel.in_flight:
                raise AssertionError(f"{got} pushed, {len(seen)} distinct, of {total}; "
                                     f"{channel.depth()} waiting, {len(channel.in_flight)} in flight")
    return {"publish_ns": (published - start) / total * 1e9, "consume_ns": (done - published) / total * 1e9}


def main() -> None:
    cost_main("nsq_backlog_cost", __doc__, "message (PUB to a waiting channel, push, FIN)",
              ("publish_ns", "consume_ns"), WINDOW, ROUND)


if __name__ == "__main__":
    main()

"""dmq-server's CPU per message with one channel, without sockets or PostgreSQL: the
whole path of e2e1 (``bench/reliable.py``), publish half included.

``channel_cost.py`` measures a copy's push and ack; this measures what a message costs
from the bytes of its ``UP_PRODUCER_SEND`` to the row of its durable ack: the real
``DmqConnection`` (on a string transport, as the unit tests run it) decodes the send,
the real ``Broker`` and ``ReliableStore`` queue it for the group commit, a stand-in
writer answers the batch as PostgreSQL would (id, pair, published time, channels), the
store answers the producer (``SEND_SUCCESS_ACK``) and pushes the copy to the consumer's
connection; that consumer acks a round's copies in one ``UP_CONSUMER_ACKS``, and the
acker's batch goes to a stand-in that answers the ack statement at once. Everything the
server runs between the two stand-ins is dmq's own code, timers included (the clock
moves by the ack flush interval each round).

Not in the figure: the kernel's socket work, psycopg dumping the parameters and parsing
the answer (``param_cost.py`` measures the dump), and PostgreSQL. In the figure, besides
the server: patching each send's session id into a template frame and packing a
round's ack ids (a few hundred instructions per message, the same in every tree).

Rounds of 200 sends, a read each: the group commit holds one round's sends while the
previous round's batch is in flight, so each batch is one round (the e2e1 run's batches
average about 200 messages).

    python bench/message_cost.py                               # this tree, CPU time, 5 rounds
    python bench/message_cost.py --tree /tmp/old --tree . --instructions
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _cost as cost  # noqa: E402

ROUND = 200
BODY = b"x" * 200


class StandInWriter:
    """The group commit's connection: each batch is answered when the bench releases
    it, with the rows ``insert_messages`` returns (PostgreSQL's RETURNING, parsed)."""

    def __init__(self, clock) -> None:
        from twisted.internet.defer import Deferred  # the tree under test's Twisted

        from dmq_server.db.messages import INSERT_NEW_MESSAGES

        self._deferred = Deferred
        # trees of sessions 25 and 26 answer a topic's channels as arrays in one row
        self._channel_arrays = "array_agg(c.name" in INSERT_NEW_MESSAGES
        self.held: list[tuple[Any, object, list[int]]] = []
        self.next_id = 1
        self.published_ms = int(clock.seconds() * 1000)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def run_steps(self, steps_fn, *args) -> Any:
        steps = steps_fn(*args)
        stmt = next(steps)
        assert stmt.name == "insert_new_messages", stmt.name
        p = stmt.params
        first, channels, ms = self.next_id, ["c1"], self.published_ms
        pairs = zip(p["producers"], p["session_ids"], p["topics"])
        if "batch_topics" in p:  # from session 25 on: the channels after the rows
            rows = [(first + i, producer, session, ms, topic, None, None)
                    for i, (producer, session, topic) in enumerate(pairs)]
            if self._channel_arrays:
                answer = rows + [(None, None, None, None, topic, channels, [0]) for topic in p["batch_topics"]]
            else:  # from session 27 on: a row per channel
                answer = rows + [(None, None, None, None, topic, name, 0)
                                 for topic in p["batch_topics"] for name in channels]
        else:  # a tree before it: the channels with every row
            rows = answer = [(first + i, producer, session, ms, channels) for i, (producer, session, _) in enumerate(pairs)]
        self.next_id += len(rows)
        try:
            steps.send(answer)
        except StopIteration as stop:
            outcome = stop.value
        else:
            raise AssertionError("insert_messages_steps ran a second statement for fresh sends")
        d = self._deferred()
        self.held.append((d, outcome, [row[0] for row in rows]))
        return d

    def release(self) -> list[int]:
        """Answer the batches in flight; the ids they stored."""
        held, self.held = self.held, []
        ids: list[int] = []
        for d, outcome, stored in held:
            ids += stored
            d.callback(outcome)
        return ids


def serve(clock: Any, options: Any, database: Any, writer: StandInWriter) -> tuple[Any, Any]:
    """A started ``Broker`` on a ``database(clock)`` (a ``MemoryDb``; topic ``orders``,
    channel ``c1``) whose group commit is ``writer``: the ``PortFactory`` of its
    dmq-protocol connections, and the database."""
    from dmq_client.wire import MAGIC
    from dmq_server.broker.broker import Broker  # first: the statements a MemoryDb checks for
    from dmq_server.protocols.dmq import DmqConnection
    from dmq_server.protocols.flow import FlowLimits
    from dmq_server.protocols.listener import PortFactory

    db = database(clock)
    db.create_topic("orders", ["c1"])
    roles = {"writer0": writer, "acker": db, "loader": db, "admin": db}
    broker = Broker(options, clock, roles, "bench-node")
    started = broker.start()
    clock.advance(0)
    assert started.called
    broker.timers.startService()
    return PortFactory(clock, {MAGIC: lambda t: DmqConnection(t, broker, clock, set())}, FlowLimits()), db


def child(messages: int, check: bool = False) -> dict:
    """Run in a fresh interpreter whose path starts with the tree under test. ``check``
    decodes what each round wrote to both connections (the unit test's run): off for a
    measurement, whose instruction count would include the decoding."""
    import struct

    from twisted.internet.task import Clock

    from dmq_client.wire import MAGIC, Command, Frame, FrameDecoder, encode, pack_ids
    from dmq_server.core.options import Options
    from dmq_server.db.memory import MemoryDb

    clock = Clock()
    clock.advance(1_700_000_000)
    options = Options(commit_writers=1)

    class Database(MemoryDb):
        """The database every role but the writer plays (start-up, loads, depths, the
        periodic jobs); the ack statement is answered without the double's bookkeeping,
        as the writer's stand-in stores nothing for the double to update."""

        acks = 0

        def execute(self, stmt):  # type: ignore[override]
            if stmt.name in ("ack_new_deliveries", "ack_deliveries"):  # the first from session 27 on
                self.acks += len(stmt.params["message_ids"])
                return []
            return super().execute(stmt)

    writer = StandInWriter(clock)
    factory, db = serve(clock, options, Database, writer)
    producer, produced = cost.connect(factory, MAGIC, 50001)
    consumer, consumed = cost.connect(factory, MAGIC, 50002)
    consumer.dataReceived(encode(Frame(Command.UP_SUBSCRIBE, session_id=1, topic="orders", channel="c1",
                                       credit=4 * ROUND)))
    clock.advance(0)
    produced.clear()  # SERVER_HEALTH, SUBSCRIBE_ACK
    consumed.clear()
    # a send's frame, its session id patched in per message (the offset found by encoding two)
    one = encode(Frame(Command.UP_PRODUCER_SEND, session_id=1, topic="orders", producer="p1",
                       timestamp_ms=1_700_000_000_000, body=BODY))
    two = encode(Frame(Command.UP_PRODUCER_SEND, session_id=2, topic="orders", producer="p1",
                       timestamp_ms=1_700_000_000_000, body=BODY))
    offset = next(i for i in range(len(one)) if one[i] != two[i]) - 7
    template = bytearray(one)
    ack_interval = options.ack_flush_interval
    session = 0
    publish_cpu = ack_cpu = 0.0

    def sends(count: int) -> bytes:
        nonlocal session
        reads = []
        for _ in range(count):
            session += 1
            struct.pack_into(">q", template, offset, session)
            reads.append(bytes(template))
        return b"".join(reads)

    # one send first, so that every round's sends wait for the batch before them
    producer.dataReceived(sends(1))
    rounds = messages // ROUND + 1  # the last round answers and acks the one before it
    gc.disable()  # the server runs with GC on, but its pauses would land in one half at random
    for n in range(rounds):
        data = sends(ROUND) if n < rounds - 1 else b""
        start = time.process_time()
        producer.dataReceived(data)  # queued: the previous round's batch is in flight
        released = writer.release()  # that batch commits: its sends are answered, its copies pushed
        clock.advance(0)  # the turn ends: replies and pushes written
        answered = time.process_time()
        consumer.dataReceived(encode(Frame(Command.UP_CONSUMER_ACKS, topic="orders", channel="c1",
                                           body=pack_ids(released))))
        clock.advance(ack_interval)  # the acker's batch goes to the database
        publish_cpu += answered - start
        ack_cpu += time.process_time() - answered
        if check:
            replies = FrameDecoder().feed(produced.value())
            pushes = FrameDecoder().feed(consumed.value())
            if ([f.command for f in replies] != [Command.SEND_SUCCESS_ACK] * len(released)
                    or [f.message_id for f in replies] != released
                    or [(f.command, f.message_id) for f in pushes] != [(Command.CONSUMER_PUSH, i) for i in released]):
                raise AssertionError(f"round {n}: {len(replies)} replies and {len(pushes)} pushes "
                                     f"for {len(released)} sends answered")
        produced.clear()
        consumed.clear()
    gc.enable()
    done = (rounds - 1) * ROUND
    if check and db.acks != done + 1:
        raise AssertionError(f"{db.acks} durable acks for {done + 1} acked copies")
    return {"publish_ns": publish_cpu / max(1, done) * 1e9, "ack_ns": ack_cpu / max(1, done) * 1e9}


def main() -> None:
    cost.main("message_cost", __doc__, "message (publish, push, ack)", ("publish_ns", "ack_ns"), 2 * ROUND, ROUND)


if __name__ == "__main__":
    main()

"""The event loop's own CPU a message when each message arrives in a read of its own: the
floor under dmq-server's figure in ``reliable.py``'s steady scenario.

At 5,000 msgs/s from four paced producers nearly every read holds one send, so whatever
a loop spends to wake, read and write is paid once a message instead of once a few
hundred (the full-load scenarios). This measures that part alone: a server that does
nothing with a message but answer it, on several event loops, against the same paced
clients.

Each round starts the server in a fresh interpreter, connects four client processes
(TCP_NODELAY, one 264-byte write per message, the size of a steady ``UP_PRODUCER_SEND``
with a 200-byte body, message k of a client due at its start + k / its share of
``--rate``) and reads the server's user and system CPU from /proc over the clients'
``--seconds``. Every message is answered with 16 bytes; a client counts the bytes it
read back, so a round where the server fell behind says so.

Loops (``--loops``):

  twisted           Twisted's epoll reactor, ``transport.write`` of the answer in
                    ``dataReceived`` (written on the reactor's next pass)
  twisted-gathered  the same reactor; the answers gathered and written to each connection
                    every ``--interval`` (1.5 ms), as dmq's group commit answers a batch
  twisted-uvloop    Twisted's asyncio reactor on a uvloop event loop, gathered answers
  uvloop            an asyncio ``Protocol`` on uvloop, answered in ``data_received``
  selectors         a plain ``selectors`` loop, ``recv`` and ``send`` on each read

The rounds alternate the loops; printed per loop: the median and lowest server CPU a
message over the rounds, split into user and system time.

    python bench/reactor_floor.py                       # 5,000 msgs/s, 10 s, 3 rounds
    python bench/reactor_floor.py --rate 1000 --loops twisted,twisted-gathered
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import _stat_fields  # noqa: E402

LOOPS = ("twisted", "twisted-gathered", "twisted-uvloop", "uvloop", "selectors")
CLIENTS = 4
SEND = b"x" * 264  # a steady scenario's UP_PRODUCER_SEND: 200-byte body, its topic and producer
ANSWER = b"a" * 16
_CLK_TCK = os.sysconf("SC_CLK_TCK")


class WholeSends:
    """The sends a connection's reads complete: TCP may split a write or join two, so a
    read owes an answer for each send it finishes, none for a part."""

    __slots__ = ("partial",)

    def __init__(self) -> None:
        self.partial = 0

    def completed(self, data: bytes) -> int:
        count, self.partial = divmod(self.partial + len(data), len(SEND))
        return count


def _twisted_server(port_q: Any, loop: str, interval: float) -> None:
    if loop == "twisted-uvloop":
        import asyncio

        import uvloop

        from twisted.internet import asyncioreactor

        event_loop = uvloop.new_event_loop()
        asyncio.set_event_loop(event_loop)
        asyncioreactor.install(event_loop)
    else:
        from twisted.internet import epollreactor

        epollreactor.install()
    from twisted.internet import reactor
    from twisted.internet.protocol import Factory, Protocol
    from twisted.internet.task import LoopingCall

    owed: dict[Any, int] = {}  # connection -> answers not yet written (gathered loops)
    gathered = loop != "twisted"

    class Answer(Protocol):
        def connectionMade(self) -> None:
            self.transport.setTcpNoDelay(True)
            self.sends = WholeSends()

        def dataReceived(self, data: bytes) -> None:
            count = self.sends.completed(data)
            if not count:
                return
            if gathered:
                owed[self] = owed.get(self, 0) + count
            else:
                self.transport.write(ANSWER * count)

    def write_owed() -> None:
        for connection, count in owed.items():
            connection.transport.write(ANSWER * count)
        owed.clear()

    if gathered:
        LoopingCall(write_owed).start(interval, now=False)
    port = reactor.listenTCP(0, Factory.forProtocol(Answer), interface="127.0.0.1")
    port_q.put(port.getHost().port)
    reactor.run()


def _uvloop_server(port_q: Any) -> None:
    import asyncio

    import uvloop

    class Answer(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport
            self.sends = WholeSends()
            transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def data_received(self, data: bytes) -> None:
            count = self.sends.completed(data)
            if count:
                self.transport.write(ANSWER * count)

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(Answer, "127.0.0.1", 0)
        port_q.put(server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    uvloop.run(serve())


def _selectors_server(port_q: Any) -> None:
    import selectors

    selector = selectors.DefaultSelector()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    selector.register(listener, selectors.EVENT_READ)
    port_q.put(listener.getsockname()[1])
    while True:
        for key, _ in selector.select():
            sock = key.fileobj
            if sock is listener:
                conn, _ = listener.accept()
                conn.setblocking(False)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                selector.register(conn, selectors.EVENT_READ, WholeSends())
                continue
            data = sock.recv(65536)
            if not data:
                selector.unregister(sock)
                sock.close()
            elif count := key.data.completed(data):
                sock.send(ANSWER * count)


def serve(port_q: Any, loop: str, interval: float) -> None:
    """The server process: answer every message on ``loop`` until killed."""
    if loop.startswith("twisted"):
        _twisted_server(port_q, loop, interval)
    elif loop == "uvloop":
        _uvloop_server(port_q)
    else:
        _selectors_server(port_q)


def client(port: int, rate: float, seconds: float, ready: Any, start: Any, out: Any) -> None:
    """One paced producer: message k written when due (start + k / rate); answers read
    as they come, without blocking the schedule. Says when it is connected; reports
    (sent, answered)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    ready.put(True)
    start.wait()
    sent = answered = 0
    t0 = time.perf_counter()
    end = t0 + seconds

    def read_answers(wait: float, expected: int | None = None) -> int:
        """Answer bytes read until ``wait`` has passed (or, with ``expected``, as soon as
        that many have come)."""
        got = 0
        deadline = time.perf_counter() + wait
        while expected is None or got < expected:
            try:
                chunk = sock.recv(65536)
            except BlockingIOError:
                if time.perf_counter() >= deadline:
                    return got
                time.sleep(min(0.0002, max(0.0, deadline - time.perf_counter())))
                continue
            if not chunk:
                return got
            got += len(chunk)
        return got

    while True:
        due = t0 + sent / rate
        if due >= end:
            break
        wait = due - time.perf_counter()
        if wait > 0:
            answered += read_answers(wait)
        sock.sendall(SEND)
        sent += 1
    # the last answers (a gathered loop holds them an interval; a loaded machine longer)
    answered += read_answers(30.0, expected=sent * len(ANSWER) - answered)
    sock.close()
    out.put((sent, answered // len(ANSWER)))


def cpu_ticks(pid: int) -> tuple[int, int]:
    fields = _stat_fields(pid)
    if fields is None:
        raise RuntimeError(f"server process {pid} is gone")
    return int(fields[11]), int(fields[12])


def one_round(loop: str, rate: float, seconds: float, interval: float) -> dict:
    ctx = mp.get_context("spawn")  # each loop in a fresh interpreter: no reactor left installed
    port_q, ready, out, start = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve, args=(port_q, loop, interval), daemon=True)
    server.start()
    try:
        port = port_q.get(timeout=30)
        clients = [ctx.Process(target=client, args=(port, rate / CLIENTS, seconds, ready, start, out), daemon=True)
                   for _ in range(CLIENTS)]
        for c in clients:
            c.start()
        for _ in clients:
            ready.get(timeout=30)  # connected: the accepts are in the baseline, not the figure
        user0, sys0 = cpu_ticks(server.pid)
        start.set()
        results = [out.get(timeout=seconds + 60) for _ in clients]
        user1, sys1 = cpu_ticks(server.pid)
        for c in clients:
            c.join(10)
    finally:
        server.kill()
        server.join(10)
    sent = sum(r[0] for r in results)
    answered = sum(r[1] for r in results)
    per = 1e6 / _CLK_TCK / max(sent, 1)
    return {"loop": loop, "sent": sent, "answered": answered,
            "user_us": (user1 - user0) * per, "sys_us": (sys1 - sys0) * per}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=5000.0, help="messages a second from the four clients")
    parser.add_argument("--seconds", type=float, default=10.0, help="paced seconds a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.0015,
                        help="the gathered loops' answer interval (dmq's --commit-interval)")
    parser.add_argument("--loops", default=",".join(LOOPS), help="comma-separated, of: " + ", ".join(LOOPS))
    args = parser.parse_args()
    loops = [name for name in args.loops.split(",") if name]
    unknown = sorted(set(loops) - set(LOOPS))
    if unknown or not loops:
        parser.error(f"unknown loops {unknown}; choose from {', '.join(LOOPS)}")
    if args.rate <= 0 or args.seconds < 1 or args.rounds < 1 or not 0 < args.interval < 1:
        parser.error("--rate must be positive, --seconds at least 1, --rounds at least 1, --interval in (0, 1)")
    print(f"{args.rate:,.0f} msgs/s from {CLIENTS} paced clients, {args.seconds:g} s a round, "
          f"{args.rounds} rounds alternated; {len(SEND)}-byte sends, {len(ANSWER)}-byte answers")
    rounds: dict[str, list[dict]] = {name: [] for name in loops}
    for _ in range(args.rounds):
        for name in loops:
            rounds[name].append(one_round(name, args.rate, args.seconds, args.interval))
    print(f"{'loop':18s} {'server CPU us a message':>24s} {'user':>7s} {'system':>7s} {'answered':>10s}")
    for name, runs in rounds.items():
        totals = [r["user_us"] + r["sys_us"] for r in runs]
        median = statistics.median(totals)
        middle = min(runs, key=lambda r: abs(r["user_us"] + r["sys_us"] - median))
        answered = min(r["answered"] / max(r["sent"], 1) for r in runs)
        print(f"{name:18s} {median:11.1f} (low {min(totals):5.1f}) {middle['user_us']:7.1f} "
              f"{middle['sys_us']:7.1f} {100 * answered:9.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What an answer written through Twisted's queue costs against one sent at once
(``dmq_server.protocols.direct``), on the epoll reactor over loopback TCP.

One process runs both ends on one reactor: a client sends a 40-byte message and waits
for the server's answer before sending the next, as a paced producer's lone send is
answered (bench/reliable.py's steady scenario). The server answers with
``transport.write`` (registered for writing, written on the next poll, unregistered)
or with ``direct_writer`` (sent from the callback when nothing is held). The client
writes through Twisted's queue in both, so the difference between the two is the
server's answer alone. Rounds alternate the two; the figures are the process's CPU
time and the wall time per round trip, best and median over the rounds.

    python bench/write_cost.py                   # 5 rounds of 20,000 round trips each
    python bench/write_cost.py --rounds 7 --trips 50000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from twisted.internet.epollreactor import EPollReactor  # noqa: E402
from twisted.internet.protocol import ClientFactory, Factory, Protocol  # noqa: E402

from dmq_server.protocols.direct import direct_writer  # noqa: E402

MESSAGE = b"x" * 40


def round_trips(direct: bool, trips: int) -> tuple[float, float]:
    """(CPU µs, wall µs) per round trip, on a fresh reactor."""
    reactor = EPollReactor()
    result: list[tuple[float, float]] = []

    class Server(Protocol):
        def connectionMade(self) -> None:
            self.transport.setTcpNoDelay(True)
            self.answer = direct_writer(self.transport) if direct else self.transport.write

        def dataReceived(self, data: bytes) -> None:
            self.answer(data)

        def connectionLost(self, reason: object) -> None:  # the client is done: close all, stop
            stopped = port.stopListening()
            if stopped is not None:
                stopped.addBoth(lambda _: reactor.stop())
            else:
                reactor.stop()

    class Client(Protocol):
        def connectionMade(self) -> None:
            self.transport.setTcpNoDelay(True)
            self.left = trips
            self.cpu, self.wall = time.process_time(), time.perf_counter()
            self.transport.write(MESSAGE)

        def dataReceived(self, data: bytes) -> None:
            self.left -= 1
            if self.left:
                self.transport.write(MESSAGE)
                return
            result.append(((time.process_time() - self.cpu) / trips * 1e6,
                           (time.perf_counter() - self.wall) / trips * 1e6))
            self.transport.loseConnection()

    port = reactor.listenTCP(0, Factory.forProtocol(Server), interface="127.0.0.1")
    client = ClientFactory()
    client.protocol = Client
    reactor.connectTCP("127.0.0.1", port.getHost().port, client)
    reactor.run(installSignalHandlers=False)
    return result[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--trips", type=int, default=20_000, help="round trips per round")
    args = parser.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {"transport.write": [], "direct_writer": []}
    round_trips(True, 1000)  # warm up
    for _ in range(args.rounds):
        for name, direct in (("transport.write", False), ("direct_writer", True)):
            runs[name].append(round_trips(direct, args.trips))
    print(f"{args.rounds} rounds of {args.trips:,} round trips, both ends in one process (its CPU time)")
    print(f"{'server answers with':<20} {'CPU us best':>12} {'CPU us median':>14} {'wall us median':>15}")
    for name, got in runs.items():
        cpu = [c for c, _ in got]
        print(f"{name:<20} {min(cpu):>12.1f} {statistics.median(cpu):>14.1f} "
              f"{statistics.median(w for _, w in got):>15.1f}")


if __name__ == "__main__":
    main()

"""A TCP fault proxy on Twisted: latency, blackhole, reset and a slow trickle, on command.

The chaos suite puts one between dmq and each PostgreSQL member, between dmq and
ZooKeeper, and between clients and each dmq node, so a scenario can break one link
while the rest keep working, on loopback only, without network namespaces. It runs as
a process of its own (``python -m tests.chaos.faultproxy``), so the test process needs
no reactor, and takes commands on a control port, one line each, answered ``OK`` or
``ERR <why>``:

    <route> pass                 forward as it comes (the start)
    <route> latency <ms>         hold every chunk <ms> in each direction, in order
    <route> blackhole            accept and read, forward nothing, answer nothing
    <route> reset                abort every connection (RST) and each new one at once
    <route> trickle <bytes/s>    forward at most that many bytes a second each way
    <route> stats                connections open and accepted, bytes each way

A mode applies to the route's open connections as well as new ones. Forwarding uses
TCP flow control in ``pass`` mode (a side that cannot write pauses the other's reads);
in the delaying modes the held bytes are bounded by the scenario's duration.

    python -m tests.chaos.faultproxy --control PORT --route NAME=LISTEN_PORT:HOST:PORT ...
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import traceback
from collections import deque
from typing import Any

from dmq_sql.ports import fresh_port

__all__ = ["FaultProxy", "main"]

MODES = ("pass", "latency", "blackhole", "reset", "trickle")


# --------------------------------------------------------------------------- the program
def _program(argv: list[str]) -> None:
    from twisted.internet import protocol, reactor
    from twisted.protocols.basic import LineOnlyReceiver

    class Direction:
        """One way of one connection: bytes held for latency or trickle, in order."""

        def __init__(self, route: "Route", out: Any, counter: str):
            self.route = route
            self.out = out  # the transport written to
            self.counter = counter
            self.held: deque[tuple[float, bytes]] = deque()
            self.timer: Any = None

        def feed(self, data: bytes) -> None:
            mode, arg = self.route.mode, self.route.arg
            if mode == "blackhole":
                return
            if mode == "pass" and not self.held:
                self._write(data)
                return
            due = reactor.seconds() + (arg / 1000.0 if mode == "latency" else 0.0)
            self.held.append((due, data))
            self._schedule()

        def _write(self, data: bytes) -> None:
            self.route.stats[self.counter] += len(data)
            self.out.write(data)

        def _schedule(self) -> None:
            if self.timer is None or not self.timer.active():
                self.timer = reactor.callLater(0.05 if self.route.mode == "trickle" else 0.0, self.flush)

        def flush(self) -> None:
            """Write what is due: everything in pass mode, what has waited long enough
            under latency, a twentieth of the rate under trickle (every 50 ms)."""
            self.timer = None
            mode, arg = self.route.mode, self.route.arg
            if mode == "blackhole":
                self.held.clear()
                return
            now = reactor.seconds()
            budget = max(1, int(arg / 20)) if mode == "trickle" else None
            while self.held:
                due, data = self.held[0]
                if mode == "latency" and due > now:
                    self.timer = reactor.callLater(due - now, self.flush)
                    return
                if budget is not None:
                    if budget <= 0:
                        break
                    if len(data) > budget:
                        self.held[0] = (due, data[budget:])
                        data = data[:budget]
                    else:
                        self.held.popleft()
                    budget -= len(data)
                else:
                    self.held.popleft()
                self._write(data)
            if self.held:
                self._schedule()

    class Upstream(protocol.Protocol):
        def __init__(self, client: "Downstream"):
            self.client = client

        def connectionMade(self) -> None:
            self.client.upstream_ready(self)

        def dataReceived(self, data: bytes) -> None:
            self.client.to_client.feed(data)

        def connectionLost(self, reason: Any) -> None:
            self.client.transport.loseConnection()

    class Downstream(protocol.Protocol):
        def __init__(self, route: "Route"):
            self.route = route
            self.upstream: Upstream | None = None
            self.early: list[bytes] = []
            self.to_client: Direction | None = None
            self.to_server: Direction | None = None

        def connectionMade(self) -> None:
            self.route.stats["accepted"] += 1
            if self.route.mode == "reset":
                self.abort()
                return
            self.route.connections.add(self)
            self.transport.pauseProducing()
            factory = protocol.ClientFactory()
            factory.buildProtocol = lambda addr: Upstream(self)  # type: ignore[method-assign]
            factory.clientConnectionFailed = lambda connector, reason: self.transport.loseConnection()  # type: ignore[method-assign]
            reactor.connectTCP(self.route.host, self.route.port, factory, timeout=5)

        def upstream_ready(self, upstream: Upstream) -> None:
            self.upstream = upstream
            self.to_client = Direction(self.route, self.transport, "bytes_to_client")
            self.to_server = Direction(self.route, upstream.transport, "bytes_to_server")
            # TCP flow control across the proxy: a side that cannot write pauses the other
            self.transport.registerProducer(upstream.transport, True)
            upstream.transport.registerProducer(self.transport, True)
            self.transport.resumeProducing()

        def dataReceived(self, data: bytes) -> None:
            if self.to_server is not None:
                self.to_server.feed(data)

        def connectionLost(self, reason: Any) -> None:
            self.route.connections.discard(self)
            if self.upstream is not None:
                self.upstream.transport.loseConnection()

        def abort(self) -> None:
            """Close with a RST (SO_LINGER 0), both sides, nothing flushed."""
            for transport in (self.transport, self.upstream.transport if self.upstream else None):
                # a side already gone (the server closed it; this side's close is on its
                # way) has no socket left, and getHandle() raises AttributeError: our reading
                # of a CI run whose proxy dropped its control connection at a reset
                # (session 17; the proxy's log was lost with the cluster)
                if transport is None or transport.disconnected:
                    continue
                try:
                    transport.getHandle().setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                except (OSError, AttributeError):
                    pass
                transport.abortConnection()

        def wake(self) -> None:
            for direction in (self.to_client, self.to_server):
                if direction is not None:
                    direction.flush()

    class Route(protocol.Factory):
        def __init__(self, name: str, host: str, port: int):
            self.name, self.host, self.port = name, host, port
            self.mode, self.arg = "pass", 0.0
            self.connections: set[Downstream] = set()
            self.stats = {"accepted": 0, "bytes_to_client": 0, "bytes_to_server": 0}

        def buildProtocol(self, addr: Any) -> Downstream:
            return Downstream(self)

        def set_mode(self, mode: str, arg: float) -> None:
            self.mode, self.arg = mode, arg
            for conn in list(self.connections):
                if mode == "reset":
                    conn.abort()
                else:
                    conn.wake()

    class Control(LineOnlyReceiver):
        delimiter = b"\n"

        def lineReceived(self, line: bytes) -> None:
            try:
                answer = self.factory.command(line.decode(errors="replace").split())
            except Exception as exc:  # answered, so the test names it; the control line stays up
                traceback.print_exc(file=sys.stderr)  # into the proxy's log (ChaosCluster.logs)
                answer = f"ERR {type(exc).__name__}: {exc}"
            self.sendLine(answer.encode())

    class ControlFactory(protocol.Factory):
        protocol = Control

        def __init__(self, routes: dict[str, Route]):
            self.routes = routes

        def command(self, words: list[str]) -> str:
            if len(words) < 2 or words[0] not in self.routes:
                return f"ERR unknown route or command: {' '.join(words)!r}"
            route, verb = self.routes[words[0]], words[1]
            if verb == "stats":
                return "OK " + " ".join(f"{k}={v}" for k, v in
                                        dict(route.stats, open=len(route.connections), mode=route.mode).items())
            if verb not in MODES:
                return f"ERR unknown mode {verb!r} (one of {', '.join(MODES)})"
            needs_arg = verb in ("latency", "trickle")
            try:
                arg = float(words[2]) if needs_arg else 0.0
            except (IndexError, ValueError):
                return f"ERR {verb} needs a number"
            if needs_arg and arg <= 0:
                return f"ERR {verb} needs a number above 0"
            route.set_mode(verb, arg)
            return "OK"

    parser = argparse.ArgumentParser(prog="faultproxy")
    parser.add_argument("--control", type=int, required=True)
    parser.add_argument("--route", action="append", default=[], help="NAME=LISTEN_PORT:HOST:PORT")
    args = parser.parse_args(argv)
    routes: dict[str, Route] = {}
    for spec in args.route:
        name, rest = spec.split("=", 1)
        listen, host, port = rest.split(":")
        routes[name] = Route(name, host, int(port))
        reactor.listenTCP(int(listen), routes[name], interface="127.0.0.1")
    reactor.listenTCP(args.control, ControlFactory(routes), interface="127.0.0.1")
    print("ready", flush=True)
    reactor.run()


def main(argv: list[str] | None = None) -> None:
    _program(sys.argv[1:] if argv is None else argv)


# --------------------------------------------------------------------------- the handle
class FaultProxy:
    """The proxy process and its routes: ``address(name)`` is where to connect instead
    of the route's target; ``set(name, mode, arg)`` changes what happens on the way."""

    def __init__(self, targets: dict[str, tuple[str, int]], log_path: Any = None):
        self.control_port = fresh_port()
        self.ports = {name: fresh_port() for name in targets}
        self.targets = dict(targets)
        cmd = [sys.executable, "-m", "tests.chaos.faultproxy", "--control", str(self.control_port)]
        for name, (host, port) in targets.items():
            cmd += ["--route", f"{name}={self.ports[name]}:{host}:{port}"]
        from pathlib import Path

        repo = Path(__file__).resolve().parents[2]
        log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, cwd=repo)
        if log_path:
            log.close()
        line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            self.proc.kill()
            raise RuntimeError(f"fault proxy did not start: {line!r}")
        self._control = socket.create_connection(("127.0.0.1", self.control_port), timeout=10)
        self._reader = self._control.makefile("rb")

    def address(self, name: str) -> tuple[str, int]:
        return "127.0.0.1", self.ports[name]

    def command(self, line: str) -> str:
        self._control.sendall(line.encode() + b"\n")
        answer = self._reader.readline().decode().strip()
        if not answer.startswith("OK"):
            raise RuntimeError(f"fault proxy: {line!r}: {answer}")
        return answer

    def set(self, name: str, mode: str, arg: float | None = None) -> None:
        self.command(f"{name} {mode}" + (f" {arg:g}" if arg is not None else ""))

    def set_all(self, names: list[str], mode: str, arg: float | None = None) -> None:
        for name in names:
            self.set(name, mode, arg)

    def stats(self, name: str) -> dict[str, str]:
        return dict(pair.split("=", 1) for pair in self.command(f"{name} stats").split()[1:])

    def close(self) -> None:
        try:
            self._reader.close()
            self._control.close()
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


if __name__ == "__main__":
    main()

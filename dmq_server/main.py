"""``dmq-server``: parse options, start the service tree, run the reactor."""

from __future__ import annotations

import gc
import signal
import sys
from typing import Any, Sequence

from twisted.logger import Logger

from dmq_server.core.options import options_from_args
from dmq_server.logs import start_logging

__all__ = ["main"]

log = Logger()


def _tune_gc() -> None:
    """Collect less often. Every message allocates a handful of short-lived container
    objects (frames, deliveries, closures); with CPython's default gen-0 threshold of
    700 the collector ran every few dozen messages and took about a third of the
    reactor thread's time in the reliable-path benchmark (docs/benchmarks.md). The
    objects are freed by reference counting anyway; cycles are rare and still found."""
    gc.collect()
    gc.freeze()  # what start-up allocated lives for the whole process
    gc.set_threshold(50_000, 20, 100)


def _console_line(server: Any, options: Any) -> str:
    """The banner's admin console line: where it listens, or why it does not."""
    address = server.console_address
    if address is not None:
        return f"{address[0]}:{address[1]}  (admin console, line commands: nc {address[0]} {address[1]})"
    if not options.admin_address:
        return "console off (--admin-address is empty)"
    return f"console NOT listening on {options.admin_address} (see the log above)"


def _stop_on_signals(reactor: Any) -> None:
    """SIGTERM and SIGINT stop the node, once. Twisted's own handlers call
    ``reactor.stop()`` on every signal, so a second SIGTERM during a slow stop logged a
    ReactorNotRunning traceback; here a repeat only says the stop is under way (every
    wait in it is bounded, docs/operations.md). The handler itself only hands the
    request to the reactor thread."""
    stopping = [False]

    def mark_stopping() -> None:  # whoever stopped the reactor
        stopping[0] = True

    def request_stop(name: str) -> None:
        from twisted.internet.error import ReactorNotRunning

        if not stopping[0]:
            stopping[0] = True
            log.info("received {signal}, shutting down", signal=name)
            try:
                reactor.stop()
                return
            except ReactorNotRunning:  # stopped by the code a moment ago (a failed start)
                pass
        log.info("received {signal} while already stopping; the stop is under way", signal=name)

    def handler(signum: int, _frame: Any) -> None:
        reactor.callFromThread(request_stop, signal.Signals(signum).name)

    reactor.addSystemEventTrigger("before", "shutdown", mark_stopping)
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, handler)


def main(argv: Sequence[str] | None = None) -> int:
    from dmq_client.pipes import quiet_broken_pipe

    with quiet_broken_pipe() as closed:  # `dmq-server --help | head`: no traceback
        return _serve(argv)
    return closed.code


def _serve(argv: Sequence[str] | None) -> int:
    options = options_from_args(argv)
    observer = start_logging(sys.stderr, options.log_format, options.log_level)
    from twisted.internet import reactor

    from dmq_server.service import make_service

    service = make_service(options, reactor)
    server = service.server
    observer.node_id = server.node_id  # on every line from here on
    exit_code = [0]

    def ready(_: Any) -> None:
        _tune_gc()
        tcp_host, tcp_port = server.tcp_address
        http_host, http_port = server.http_address
        lines = [
            "dmq is ready",
            f"  node id      {server.node_id}",
            f"  data path    {options.data_dir}",
            f"  PostgreSQL   {server.dsn}" + ("  (embedded)" if server.embedded else ""),
            f"  TCP          {tcp_host}:{tcp_port}  (dmq protocol and NSQ V2)",
            f"  HTTP         http://{http_host}:{http_port}/  (/ping, /stats, /metrics, /info, nsqd and lookup APIs, /admin)",
            "  admin        " + _console_line(server, options),
            "  admin CLI    dmq --data-path "
            + str(options.data_dir)
            + " topic create NAME; dmq channel add NAME CHANNEL",
        ]
        try:
            print("\n".join(lines), flush=True)
        except BrokenPipeError:  # nobody reads our stdout (`dmq-server | head -1`): serve on
            pass

    def failed(failure: Any) -> None:
        print(f"dmq-server: failed to start: {failure.getErrorMessage()}", file=sys.stderr, flush=True)
        exit_code[0] = 1
        from twisted.internet.error import ReactorNotRunning

        try:
            reactor.stop()
        except ReactorNotRunning:  # a stop was already under way (a signal during start)
            pass

    reactor.callWhenRunning(service.startService)
    service.ready.addCallbacks(ready, failed)
    reactor.addSystemEventTrigger("before", "shutdown", service.stopService)
    _stop_on_signals(reactor)
    # no Twisted signal handlers: ours above stop once; nothing here spawns processes
    # through the reactor (which would need its SIGCHLD handler)
    reactor.run(installSignalHandlers=False)
    return exit_code[0]


if __name__ == "__main__":
    sys.exit(main())

"""``dmq-server``: parse options, start the service tree, run the reactor."""

from __future__ import annotations

import gc
import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING, Sequence

from twisted.logger import Logger
from twisted.python.failure import Failure

from dmq_server.core.options import Options
from dmq_server.core.options import options_from_args
from dmq_server.logs import start_logging

if TYPE_CHECKING:  # imported at run time once the logs are set up (the reactor is installed then)
    from dmq_server.service import DmqServer, ServerReactor

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


def _console_line(server: DmqServer, options: Options) -> str:
    """The banner's admin console line: where it listens, or why it does not."""
    address = server.console_address
    if address is not None:
        return f"{address[0]}:{address[1]}  (admin console, line commands: nc {address[0]} {address[1]})"
    if not options.admin_address:
        return "console off (--admin-address is empty)"
    return f"console NOT listening on {options.admin_address} (see the log above)"


def _secure_lines(server: DmqServer, options: Options) -> list[str]:
    """The banner's TLS and auth lines (none when neither is configured)."""
    info = server.info()
    lines = []
    if info.get("tls_address"):
        lines.append(f"  TLS          {info['tls_address']}  (dmq protocol and NSQ V2, TLS from the first byte)")
    if info.get("https_address"):
        lines.append(f"  HTTPS        https://{info['https_address']}/")
    if options.tls_enabled:
        lines.append(f"  TLS mode     NSQ tls_v1 upgrade on; required: {options.tls_required_mode}")
    if options.auth_enabled:
        source = f"file {options.auth_file}" if options.auth_file else f"auth server {options.auth_http_address}"
        lines.append(f"  auth         on ({source})")
    return lines


def _stop_on_signals(reactor: ServerReactor) -> None:
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

    def handler(signum: int, _frame: FrameType | None) -> None:
        reactor.callFromThread(request_stop, signal.Signals(signum).name)

    reactor.addSystemEventTrigger("before", "shutdown", mark_stopping)
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, handler)


def _reload_on_sighup(reactor: ServerReactor, server: DmqServer) -> None:
    """SIGHUP re-reads the TLS certificate, key and CA and the auth file (docs/operations.md);
    connections already open keep theirs. The handler only hands the request to the reactor."""

    def reload() -> None:
        log.info("received SIGHUP, reloading TLS and auth files")
        results = server.reload()
        failed = {what: why for what, why in results.items() if why}
        if failed:
            log.error("reload: kept the previous {what}", what=", ".join(sorted(failed)))
        else:
            log.info("reload done ({what})", what=", ".join(sorted(results)) or "nothing to reload")

    signal.signal(signal.SIGHUP, lambda signum, frame: reactor.callFromThread(reload))


def main(argv: Sequence[str] | None = None) -> int:
    from dmq_client.pipes import quiet_broken_pipe

    with quiet_broken_pipe() as closed:  # `dmq-server --help | head`: no traceback
        return _serve(argv)
    return closed.code


def _serve(argv: Sequence[str] | None) -> int:
    options = options_from_args(argv)
    observer = start_logging(sys.stderr, options.log_format, options.log_level)
    from dmq_server.service import installed_reactor, make_service

    reactor = installed_reactor()

    service = make_service(options, reactor)
    server = service.server
    observer.node_id = server.node_id  # on every line from here on
    exit_code = [0]

    def ready(_: object) -> None:
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
            f"  console      http://{http_host}:{http_port}/console/  (the web console)",
            *_secure_lines(server, options),
            "  admin        " + _console_line(server, options),
            "  admin CLI    dmq --data-path "
            + str(options.data_dir)
            + " topic create NAME; dmq channel add NAME CHANNEL",
        ]
        try:
            print("\n".join(lines), flush=True)
        except BrokenPipeError:  # nobody reads our stdout (`dmq-server | head -1`): serve on
            pass

    def failed(failure: Failure) -> None:
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
    _reload_on_sighup(reactor, server)
    # no Twisted signal handlers: ours above stop once; nothing here spawns processes
    # through the reactor (which would need its SIGCHLD handler)
    reactor.run(installSignalHandlers=False)
    return exit_code[0]


if __name__ == "__main__":
    sys.exit(main())

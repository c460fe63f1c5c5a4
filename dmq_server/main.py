"""``dmq-server``: parse options, start the service tree, run the reactor."""

from __future__ import annotations

import gc
import sys
from typing import Any, Sequence

from twisted.logger import (
    FilteringLogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    globalLogBeginner,
    textFileLogObserver,
)

from .options import options_from_args

__all__ = ["main"]

_LEVELS = {"debug": LogLevel.debug, "info": LogLevel.info, "warn": LogLevel.warn, "error": LogLevel.error}


def _start_logging(level: str) -> None:
    predicate = LogLevelFilterPredicate(defaultLogLevel=_LEVELS.get(level, LogLevel.info))
    observer = FilteringLogObserver(textFileLogObserver(sys.stderr), [predicate])
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)


def _tune_gc() -> None:
    """Collect less often. Every message allocates a handful of short-lived container
    objects (frames, deliveries, closures); with CPython's default gen-0 threshold of
    700 the collector ran every few dozen messages and took about a third of the
    reactor thread's time in the reliable-path benchmark (docs/benchmarks.md). The
    objects are freed by reference counting anyway; cycles are rare and still found."""
    gc.collect()
    gc.freeze()  # what start-up allocated lives for the whole process
    gc.set_threshold(50_000, 20, 100)


def main(argv: Sequence[str] | None = None) -> int:
    options = options_from_args(argv)
    _start_logging(options.log_level)
    from twisted.internet import reactor

    from .service import make_service

    service = make_service(options, reactor)
    server = service.server
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
            f"  HTTP         http://{http_host}:{http_port}/  (/ping, /stats, /info, nsqd and lookup APIs)",
            "  admin CLI    dmq --data-path "
            + str(options.data_dir)
            + " topic create NAME; dmq channel add NAME CHANNEL",
        ]
        print("\n".join(lines), flush=True)

    def failed(failure: Any) -> None:
        print(f"dmq-server: failed to start: {failure.getErrorMessage()}", file=sys.stderr, flush=True)
        exit_code[0] = 1
        if reactor.running:
            reactor.stop()

    reactor.callWhenRunning(service.startService)
    service.ready.addCallbacks(ready, failed)
    reactor.addSystemEventTrigger("before", "shutdown", service.stopService)
    reactor.run()
    return exit_code[0]


if __name__ == "__main__":
    sys.exit(main())

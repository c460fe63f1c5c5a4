"""Logging an outage once: when it starts, and when it ends.

A dependency that fails (PostgreSQL down, a restart in progress) makes every batcher,
loader and worker retry with backoff; a line per retry buried the one line an operator
needs (51 warnings in 20 s). Each retrying component holds an ``Outage``: the first
failure logs a warning, the retries log nothing, and the first success after them logs
how long it lasted and how many attempts failed.
"""

from __future__ import annotations

from typing import Any

from twisted.logger import Logger

__all__ = ["Outage"]

log = Logger()


class Outage:
    """The failing/working state of one component, as the log sees it."""

    def __init__(self, what: str, clock: Any):
        self.what = what
        self.clock = clock
        self.since: float | None = None  # when the current outage started
        self.failures = 0

    @property
    def ongoing(self) -> bool:
        return self.since is not None

    def failed(self, why: object) -> None:
        self.failures += 1
        if self.since is None:
            self.since = self.clock.seconds()
            log.warn("{what} failing, retrying quietly until it works: {why}", what=self.what, why=why)

    def recovered(self) -> None:
        if self.since is not None:
            log.info(
                "{what} working again after {seconds:.1f}s ({failures} failed attempts)",
                what=self.what,
                seconds=self.clock.seconds() - self.since,
                failures=self.failures,
            )
            self.since = None
            self.failures = 0

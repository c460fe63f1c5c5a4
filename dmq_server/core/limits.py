"""Per-topic publish rate limits: one token bucket per topic on this node.

A topic's ``rate_limit`` (messages per second, ``dmq topic create --rate-limit``)
refills its bucket continuously; the bucket holds at most one second's worth, so
a producer may burst up to the limit after a quiet second and no more. A send
that finds the bucket empty is refused with ``SEND_EXCEED_LIMIT_ACK`` and, on a
reliable topic, recorded as a dead letter (``rate_limited``); a fast topic's
publish is refused whole (its store keeps no dead letters). The limit is per node: N nodes admit up to
N times the limit in all, as in DMQ, where each server counts its own QPS.

Time comes from an injected clock (``seconds()``), so tests drive it with
``twisted.internet.task.Clock``.
"""

from __future__ import annotations

from dmq_server.core.clock import Clock

__all__ = ["TokenBucket", "RateLimiter"]


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` held; starts full."""

    __slots__ = ("rate", "burst", "tokens", "stamp")

    def __init__(self, rate: float, burst: float, now: float):
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate!r}")
        self.rate = float(rate)
        self.burst = float(max(burst, 1.0))
        self.tokens = self.burst
        self.stamp = now

    def take(self, now: float, count: float = 1.0) -> bool:
        """Take ``count`` tokens if there are that many; refills for the time passed."""
        elapsed = now - self.stamp
        if elapsed > 0:
            self.tokens = min(self.burst, self.tokens + elapsed * self.rate)
            self.stamp = now
        if self.tokens >= count:
            self.tokens -= count
            return True
        return False


class RateLimiter:
    """Token buckets by topic; a changed limit (registry refresh) starts a new bucket."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self.refused = 0

    def allow(self, topic: str, rate_limit: int | None, count: int = 1) -> bool:
        """True if ``count`` sends to ``topic`` fit its limit now (always, without a
        limit); a batch (a fast topic's MPUB) is admitted or refused whole."""
        if not rate_limit:
            return True
        now = self.clock.seconds()
        bucket = self._buckets.get(topic)
        if bucket is None or bucket.rate != rate_limit:
            bucket = self._buckets[topic] = TokenBucket(rate_limit, rate_limit, now)
        if bucket.take(now, count):
            return True
        self.refused += 1
        return False

    def forget(self, keep: set[str] | frozenset[str]) -> None:
        """Drop the buckets of topics no longer limited (registry refresh)."""
        for topic in list(self._buckets):
            if topic not in keep:
                del self._buckets[topic]

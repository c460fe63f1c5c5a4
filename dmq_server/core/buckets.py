"""Counts of observations by bucket: the data of a Prometheus histogram, cheap to record.

``/metrics`` shows latency and batch-size histograms (``http.metrics`` turns a
``Buckets`` into prometheus_client's ``HistogramMetricFamily``). They are recorded
here rather than with ``prometheus_client.Histogram`` because one of them is
observed once per published message on the reactor thread: the library's histogram
takes a lock and walks its buckets on every observation, a ``bisect`` into a list of
counts that only the reactor thread touches does not (timeit on the 2-core test
machine, 14 buckets: 709 ns per ``Histogram.observe``, 160 ns per ``Buckets.observe``;
docs/benchmarks.md). The scrape
reads a copy (``snapshot``), made on the reactor thread too.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

__all__ = ["Buckets", "LATENCY_SECONDS", "DELIVERY_SECONDS", "BATCH_SIZES"]

#: publish -> commit and commit round trips: 0.5 ms to 10 s
LATENCY_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: publish -> first delivery: a copy may wait in a backlog for minutes or hours
DELIVERY_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    300.0, 900.0, 3600.0)
#: messages per group commit
BATCH_SIZES = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)


class Buckets:
    """Observations counted under the smallest upper bound they do not exceed (the
    last slot is +Inf), with their sum: Prometheus' ``le`` semantics."""

    __slots__ = ("bounds", "counts", "total", "count")

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError("bucket bounds must be strictly increasing")
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def observe_many(self, value: float, times: int) -> None:
        """``observe(value)`` ``times`` times (copies published by one commit and pushed
        in one turn share their latency)."""
        self.counts[bisect_left(self.bounds, value)] += times
        self.total += value * times
        self.count += times

    def snapshot(self) -> tuple[list[tuple[str, int]], float]:
        """``([(le, cumulative count), ..., ("+Inf", count)], sum)``, as Prometheus
        writes a histogram."""
        cumulative, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            running += count
            cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return cumulative, self.total

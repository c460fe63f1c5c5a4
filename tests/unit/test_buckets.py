"""Histogram data for /metrics (dmq_server/core/buckets.py): Prometheus' ``le`` buckets."""

from __future__ import annotations

import pytest

from dmq_server.core.buckets import BATCH_SIZES, Buckets

pytestmark = pytest.mark.unit


def test_a_value_counts_in_the_first_bucket_it_does_not_exceed():
    b = Buckets((1, 5, 10))
    for value in (0.5, 1, 1.01, 5, 7, 10, 11, 1000):
        b.observe(value)
    buckets, total = b.snapshot()
    assert buckets == [("1.0", 2), ("5.0", 4), ("10.0", 6), ("+Inf", 8)]  # cumulative
    assert total == pytest.approx(1035.51) and b.count == 8


def test_bounds_must_increase():
    with pytest.raises(ValueError):
        Buckets((1, 1, 2))
    with pytest.raises(ValueError):
        Buckets((5, 1))
    assert Buckets(BATCH_SIZES).snapshot() == ([(repr(float(x)), 0) for x in BATCH_SIZES] + [("+Inf", 0)], 0.0)

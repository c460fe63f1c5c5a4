"""bench/reliable.py's steady scenario puts a latency tail on the database or on the
reactor from two scrapes of the server's histograms and its ``/stats`` stalls: the
arithmetic that turns cumulative buckets into "how many above 5/10/25 ms in this window",
and the stalls into seconds of the window."""

from __future__ import annotations

from tests.bench_modules import import_bench

reliable = import_bench("reliable")


def test_observations_above_each_bound_are_counted_between_two_scrapes():
    before = {"0.005": 90.0, "0.01": 95.0, "0.025": 99.0, "+Inf": 100.0}
    # 50 more observations: 40 at most 5 ms, 4 in (5, 10], 3 in (10, 25], 3 above 25 ms
    after = {"0.005": 130.0, "0.01": 139.0, "0.025": 146.0, "+Inf": 150.0}
    assert reliable.buckets_over(before, after) == {"5ms": 10, "10ms": 6, "25ms": 3}
    assert reliable.buckets_over(None, after) is None
    assert reliable.over_line(reliable.buckets_over(before, after)) == "10 / 6 / 3"


def test_stalls_are_those_that_began_in_the_window_by_second():
    stats = {"pauses": {
        "reactor_lag": {"stalls": [{"at": 999.8, "seconds": 0.02}, {"at": 1004.7, "seconds": 0.141},
                                   {"at": 1025.0, "seconds": 0.3}]},
        "gc": {"stalls": [{"at": 1012.2, "seconds": 0.037, "generation": 2}]},
    }}
    assert reliable.stalls_in(stats, t0=1000.0, seconds=20.0) == [
        {"second": 4, "kind": "reactor", "ms": 141.0},
        {"second": 12, "kind": "gc2", "ms": 37.0},
    ]
    assert reliable.stalls_in(None, 1000.0, 20.0) == []
    assert reliable.stalls_in({}, 1000.0, 20.0) == []

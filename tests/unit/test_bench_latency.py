"""bench/latency.py (issue 48): the arithmetic behind its figures. The reactor's run-queue
wait comes from two readings of each thread's schedstat; a send's lateness is the gap
between its latency from the due time and from its write; each second's percentiles are
taken from the due time; the summary checks dmq's p99 against its placement's bound and
against both peers'. A figure taken from the wrong field or thread fails here."""

from __future__ import annotations

from array import array

from tests.bench_modules import import_bench

latency = import_bench("latency")


def test_the_reactor_wait_is_its_own_threads_delta_per_second_and_per_message():
    # tid: (ns on a CPU, ns waiting on a run queue, timeslices)
    before = {100: (1_000_000_000, 50_000_000, 1000), 101: (0, 0, 0), 102: (5, 5, 5)}
    after = {100: (1_600_000_000, 250_000_000, 3000), 101: (400_000_000, 20_000_000, 10), 103: (9, 9, 9)}
    rq = latency.run_queue(before, after, reactor=100, seconds=2.0, messages=10_000)
    assert rq["threads"] == 2  # 102 ended and 103 began between the readings: neither counts
    assert rq["all_threads_wait_ms"] == 220.0
    assert rq["all_threads_wait_ms_per_s"] == 110.0
    assert rq["other_threads_on_cpu_ms_per_s"] == 200.0
    assert rq["reactor"] == {"wait_ms": 200.0, "wait_ms_per_s": 100.0, "wait_us_per_message": 20.0,
                             "on_cpu_ms_per_s": 300.0, "timeslices": 2000, "mean_wait_us_per_timeslice": 100.0}
    assert "reactor" not in latency.run_queue(before, after, reactor=None, seconds=2.0, messages=1)


def test_a_send_is_late_by_the_gap_between_its_two_latencies():
    prods = [{"lat_sched": array("d", [0.004, 0.010, 0.0031]).tobytes(),
              "lat": array("d", [0.0035, 0.002, 0.003]).tobytes()}]
    assert latency.late_sends(prods) == {"late_over_1ms": 1, "of": 3, "worst_ms": 8.0}


def test_each_second_has_the_three_percentiles_of_the_latency_it_is_asked_for():
    prods = [{"t_start": 100.0, "ack_at": array("d", [0.1, 0.2, 1.5]).tobytes(),
              "lat_sched": array("d", [0.002, 0.004, 0.030]).tobytes(),
              "lat": array("d", [0.001, 0.001, 0.001]).tobytes()}]
    seconds = latency.timeline(prods, 100.0, "lat_sched", (50, 99, 99.9))
    assert seconds == [
        {"second": 0, "acks": 2, "p50": 2.0, "p99": 4.0, "p99_9": 4.0, "max": 4.0},
        {"second": 1, "acks": 1, "p50": 30.0, "p99": 30.0, "p99_9": 30.0, "max": 30.0},
    ]
    # reliable.py's steady scenario still gets p50 and p99 of the latency from the write
    assert latency.timeline(prods, 100.0)[0] == {"second": 0, "acks": 2, "p50": 1.0, "p99": 1.0, "max": 1.0}


def test_the_summary_checks_each_placements_bound_and_the_peers():
    def res(p99: float) -> dict:
        return {"latency_from_due_ms": {"p99": p99}}

    rounds = {
        "pinned": {"dmq": res(4.0), "rabbit": res(30.0), "nats": res(3.5)},
        "unpinned": {"dmq": res(9.0), "rabbit": res(30.0), "nats": {"error": "did not start"}},
    }
    rows = {r["target"]: r["met"] for r in latency.summary(rounds)}
    assert rows == {
        "dmq p99 <= 5 ms, pinned": True,
        "dmq p99 lowest of the three, pinned": False,  # JetStream's 3.5 ms is lower
        "dmq p99 <= 10 ms, unpinned": True,
        "dmq p99 lowest of the three, unpinned": None,  # a peer without a figure: not decided
    }


def test_quick_rounds_are_shorter_and_the_lists_keep_their_order():
    a = latency.parse_args(["--quick", "--brokers", "nats,dmq", "--placements", "unpinned"])
    assert (a.seconds, a.warmup_seconds, a.rate) == (5.0, 1.0, 5000)
    assert a.brokers == ["dmq", "nats"] and a.placements == ["unpinned"]
    full = latency.parse_args([])
    assert (full.seconds, full.brokers, full.placements) == (20.0, ["dmq", "rabbit", "nats"], ["pinned", "unpinned"])

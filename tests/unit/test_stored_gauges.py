"""http.sampling.StoredGauges.refresh_unread: a channel's oldest copy that the depth count
has found and the gauges have not looked up is read within a history interval, not at
the next --metrics-db-interval; a channel that shows an age, or whose copy is not stored,
costs no extra read. A database role double answers by statement name, on a task.Clock.
tests/integration/test_console_browser.py shows the console's "Oldest" on a real server."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import succeed
from twisted.internet.task import Clock

from dmq_server.http.sampling import HISTORY_INTERVAL, Sampling

KEY = ("orders", "billing")


class Gauges:
    """The metrics role: a ping, and ``read_gauges`` over the publish times it holds."""

    def __init__(self, published_ms: dict[int, int]):
        self.published_ms = published_ms
        self.reads: list[dict] = []

    def _answer(self, name: str, args: tuple) -> Any:
        if name.startswith("ping"):
            return succeed(None)
        assert name.startswith("read_gauges"), name
        lowest = args[0]
        self.reads.append(dict(lowest))
        oldest = {key: self.published_ms.get(i) if i is not None else None for key, i in lowest.items()}
        return succeed({"oldest_unacked_ms": oldest, "delay_pending": {}, "dead_letters": {}})

    def run(self, fn: Any, *args: Any) -> Any:
        return self._answer(fn.__name__, args)

    def run_steps(self, steps: Any, *args: Any) -> Any:
        return self._answer(steps.__name__, args)


def started(db: Gauges, lowest: dict) -> tuple[Sampling, Clock]:
    clock = Clock()
    clock.advance(1_000)
    sampling = Sampling(db, clock, lambda: [], 3600.0, lowest=lambda: dict(lowest))
    sampling.timers.startService()  # as the listeners' stage does: each timer fires once now
    return sampling, clock


def test_an_oldest_copy_found_by_a_pass_gets_its_age_within_a_history_interval():
    db = Gauges({7: 990_000})
    lowest: dict = {KEY: None}  # no pass yet
    sampling, clock = started(db, lowest)
    assert db.reads == [{KEY: None}]  # the timed read at the start
    lowest[KEY] = 7  # a pass counted billing's first copies
    clock.advance(HISTORY_INTERVAL)
    assert db.reads[-1] == {KEY: 7} and len(db.reads) == 2  # not an hour later
    assert sampling.gauges.values["oldest_unacked_ms"] == {KEY: 990_000}
    clock.advance(HISTORY_INTERVAL * 10)
    assert len(db.reads) == 2  # read: nothing more until the timed read
    sampling.timers.stopService()


def test_no_extra_read_for_an_age_shown_or_a_copy_not_stored():
    db = Gauges({7: 990_000})
    lowest: dict = {KEY: 7, ("clicks", "stats"): 9}  # 9: stored on another cluster, or swept
    sampling, clock = started(db, lowest)
    assert len(db.reads) == 1
    lowest[KEY] = 8  # billing's oldest acknowledged: its age waits for the timed read
    clock.advance(HISTORY_INTERVAL * 10)
    assert len(db.reads) == 1
    lowest[("clicks", "stats")] = 11  # a copy not looked up, for a channel with no age: read
    clock.advance(HISTORY_INTERVAL)
    assert len(db.reads) == 2
    sampling.timers.stopService()

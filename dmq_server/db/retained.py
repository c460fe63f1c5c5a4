"""How many messages and body bytes each reliable topic keeps, counted as the sweep goes.

Counting a topic's rows on every ``/stats`` would read millions of rows; so the retention
sweep's pass counts each topic incrementally, and the node reads the figures
(``dmq_retained``, schema 22) with its channel state. For a topic the figures are exact
for its rows with an id up to ``counted_to``:

* a pass finds a *settled* id (``settle_point_steps``): one below which no row can still
  become visible, so a row counted past is never followed by another committed below it;
* each topic visited adds its rows in (``counted_to``, settled] (``count_topic_steps``),
  read per incarnation from the topic's own index range, at most ``COUNT_BATCH`` rows a
  statement (the first pass over a store of ten million rows is many short statements,
  not one long one), under the topic's sweep lock, so two nodes never count one topic at
  once and a count never runs beside the topic's delete;
* the sweep's delete takes off exactly the rows it removes at or below ``counted_to``,
  in its own transaction (``uncount_swept``): rows above it were never added.

Why an id is settled. A message's ``published_at`` is its transaction's now(), and its id
is drawn after it, at most ``SEEK_SKEW_MS`` (S) later (``db.seek``'s assumption). Let W
be the start of the oldest transaction writing in the database now (``count_settle_time``:
``pg_stat_activity``, which shows the sessions of the nodes' own role) and T = min(now -
S, W). ``seek_bounds_steps(T, S)`` finds ``lo``, a row published at or before T - S, with
every id up to it published before T. A row m with an id below ``lo`` that is not visible
yet would belong to a transaction that started before T <= W and is still open: if it has
inserted, it is a writer older than W, a contradiction; if it has not, the id it draws is
above every id drawn so far, ``lo`` among them. (Without the writer test, a commit that
waited longer than S after its insert, e.g. for a synchronous standby, would be missed for
good; a role that cannot see the nodes' sessions leaves only the skew: ~2 S.)

``counted_ms``, shown as ``retained_as_of``: ``lo``'s publish time less S. Every message
published before it has an id below ``lo`` (a higher id is published after pub(lo) - S),
so it is counted; messages published after it are mostly not counted yet (the figures
run about a minute and a sweep interval behind). A store with no row at all has nothing
to count below T - S either: the point moves there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from dmq_server.db.messages import SweepTarget, sweep_plan_steps
from dmq_server.db.seek import SEEK_SKEW_MS, seek_bounds_steps
from dmq_server.db.steps import Statement, Steps

__all__ = ["COUNT_BATCH", "Retained", "SettlePoint", "settle_time", "settle_point_steps", "sweep_pass_plan_steps", "count_plan_steps",
           "count_topic_steps", "retained_figures_steps", "retained_stats"]

#: rows counted at most by one statement (a statement of 50,000 reads as many heap tuples:
#: tens of milliseconds, where 10 million in one would hold a backend for a minute)
COUNT_BATCH = 50_000


@dataclass(frozen=True, slots=True)
class SettlePoint:
    """Where a pass counts to: every row with an id up to ``upto`` is visible, and every
    message published before ``counted_ms`` has such an id. ``upto`` None: no row is known
    settled (the count stays where it is; ``counted_ms`` then says only how far an empty
    store is exact, or is None)."""

    upto: int | None
    counted_ms: int | None


@dataclass(frozen=True, slots=True)
class Retained:
    """A topic's retained figures on one cluster (``retained_figures``): messages, body
    bytes, and the publish time before which every message is counted (None: not yet)."""

    messages: int
    bytes: int
    as_of_ms: int | None


def settle_time(now_ms: int, oldest_writer_ms: int | None, skew_ms: int = SEEK_SKEW_MS) -> int:
    """T of the module's docstring: S before now, or the start of the oldest transaction
    still writing if that is earlier (None: there is none)."""
    return now_ms - skew_ms if oldest_writer_ms is None else min(now_ms - skew_ms, oldest_writer_ms)


def settle_point_steps(skew_ms: int = SEEK_SKEW_MS) -> Steps[SettlePoint]:
    """The pass's settled point (see the module's docstring). One statement for the time,
    then the seek's binary search of the primary key (about 20 probes a million ids)."""
    ((now_ms, oldest_writer_ms),) = yield Statement("count_settle_time", {})
    point = settle_time(now_ms, oldest_writer_ms, skew_ms)
    bounds = yield from seek_bounds_steps(point, skew_ms)
    if bounds.lo is None:
        ((lowest, _),) = yield Statement("seek_ends", {})
        # nothing stored: a row published before point - S would have drawn its id by now
        return SettlePoint(None, point - skew_ms if lowest is None else None)
    ((_, found, published_us),) = yield Statement("seek_probe", {"at": [bounds.lo]})
    if found != bounds.lo:  # swept since the search found it: the next pass finds another
        return SettlePoint(None, None)
    return SettlePoint(bounds.lo, published_us // 1000 - skew_ms)


def sweep_pass_plan_steps(
    default_retention_s: float, starts: Mapping[float, int], skew_ms: int = SEEK_SKEW_MS
) -> Steps[tuple[list[SweepTarget], dict[float, int], SettlePoint, list[str]]]:
    """A retention sweep's pass, planned in one transaction: the topics to sweep and the
    next pass's starts (``sweep_plan_steps``), then the count's point and topics
    (``count_plan_steps``)."""
    targets, next_starts = yield from sweep_plan_steps(default_retention_s, starts)
    point, topics = yield from count_plan_steps(skew_ms)
    return targets, next_starts, point, topics


def count_plan_steps(skew_ms: int = SEEK_SKEW_MS) -> Steps[tuple[SettlePoint, list[str]]]:
    """A pass's count: its settled point, and the topics it visits: those with a message
    stored (``sweep_topics``, deleted ones too) and those counted before (whose rows may all
    have gone since: their figures become exact up to the new point)."""
    point = yield from settle_point_steps(skew_ms)
    stored = yield Statement("sweep_topics", {})
    counted = yield Statement("retained_topics", {})
    return point, sorted({name for name, _ in stored} | {name for (name,) in counted})


def count_topic_steps(topic: str, point: SettlePoint, limit: int = COUNT_BATCH) -> Steps[int | None]:
    """One batch of ``topic``'s count up to ``point``, in one transaction under the topic's
    sweep lock: None when another node holds it (it sweeps or counts the topic now); else
    how many rows were added (``limit``: more follow, run it again). A topic no longer
    registered whose rows are all gone loses its figures."""
    ((_, mine),) = yield Statement("sweep_topic_lock", {"topic": topic})
    if not mine:
        return None
    if point.upto is not None:
        ((counted, _),) = yield Statement("count_retained", {
            "topic": topic, "upto": point.upto, "limit": limit, "counted_ms": point.counted_ms})
    else:
        counted = 0
        if point.counted_ms is not None:  # an empty store: exact up to the point
            yield Statement("count_retained", {
                "topic": topic, "upto": 0, "limit": limit, "counted_ms": point.counted_ms})
    if counted < limit:
        yield Statement("drop_retained", {"topic": topic}, count=True)
    return int(counted)


def retained_figures_steps() -> Steps[dict[str, Retained]]:
    """Every topic's figures on this cluster (a node reads them with its channel state)."""
    rows = yield Statement("retained_figures", {})
    return {topic: Retained(int(n), int(b), ms) for topic, n, b, ms in rows}


def retained_stats(parts: Iterable[Retained | None]) -> dict[str, int | None]:
    """A topic's figures over the clusters that hold its rows (a topic moved with ``dmq
    topic move`` keeps rows on the cluster it left until they are swept), as /stats shows
    them: ``retained_messages`` and ``retained_bytes`` added up, ``retained_as_of`` the
    earliest of the clusters' (before it, every cluster counted every message), None while
    a cluster's first count is under way or none counted the topic yet."""
    found = [part for part in parts if part is not None]
    as_of = [part.as_of_ms for part in found]
    return {
        "retained_messages": sum(part.messages for part in found),
        "retained_bytes": sum(part.bytes for part in found),
        "retained_as_of": None if not as_of or None in as_of else min(ms for ms in as_of if ms is not None),
    }

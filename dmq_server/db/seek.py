"""Seeking a channel (issue 46): its targets, the search of a time, and the seek itself, as steps.

A channel's delivery state in PostgreSQL is a cursor per incarnation (``dmq_cursor``: every
id up to ``floor`` done, and the ``done`` ranges above it) and its ``start_id``. A seek
writes every cursor of the channel anew, in one transaction (``seek_channel`` in
sql/queries.sql): after it, the channel's copies waiting are exactly the messages of the
topic stored from the target on, whatever was acknowledged before, and nothing before the
target waits any more (absolute, as Kafka's and Pulsar's resets). Its ``epoch`` rises, so a
node's acknowledgement of a copy pushed before the seek cannot undo it.

A target becomes, per incarnation o, a floor F_o and done ranges D_o above it:

* ``ToId(n)``: F = n - 1 for every incarnation, no done ranges;
* ``ToLatest()``: F_o = o's highest id of the topic (nothing waits; one without a message of
  the topic keeps the channel's start);
* ``ToTime(ms)``: no index on the publish time. A message's ``published_at`` is its insert
  transaction's now(), taken before its id is drawn, so ids follow publish times only up
  to that wait (``SEEK_SKEW_MS``, S): if id(m) < id(x), published(m) < published(x) + S. So
  with ``lo`` a row published at or before T - S, every id up to lo was published before
  T; with ``hi`` a row published at or after T + S, every id from hi on was published at
  or after T. Both are found by a binary search of the primary key (``seek_bounds_steps``,
  both searches in one statement a step: log2 of the stored ids' span, ~20 steps for a
  million rows); F = lo, and D_o = o's ids in (lo, hi) published before T, read from the
  topic's index over that window only (about 2 S of the topic's messages).

An insert that waits longer than S between its now() and its id breaks the exactness (a
message published before T would be delivered again, or one after T not): S is 30 s.

``from_archive``: a time before the topic's retained start is not refused; the channel is
sought to the retained start (swept_ms + 1) and ``Sought.gap`` names what the store no longer
holds, ``[T, swept_ms + 1)``, with the archive this database is archived to, for
``dmq-pipeline reinject`` to queue it for the channel from there (docs/pipeline.md). The seek
cannot run that job itself: the pipeline is another distribution, on Spark.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Union

import dataclasses

from registry.model import TopicSpec

from dmq_server.db.steps import Statement, Steps
from dmq_server.db.topic_steps import mirror_topics_steps

__all__ = [
    "SEEK_SKEW_MS", "ToId", "ToLatest", "ToTime", "SeekTarget", "SeekBounds", "Sought",
    "ArchiveGap", "SeekRefused", "NoSuchChannel", "BeforeRetainedStart", "NotArchived", "SeekInFuture",
    "PastTimeToLive",
    "seek_bounds_steps", "seek_channel_steps", "start_channel_steps", "iso_ms",
]

#: the longest wait assumed between a message's publish time (its transaction's now()) and
#: the drawing of its id: a seek to a time reads the messages within it of the target one by one
SEEK_SKEW_MS = 30_000


@dataclass(frozen=True, slots=True)
class ToId:
    """Deliver again every message of the topic with this id or a higher one."""

    message_id: int

    def __post_init__(self) -> None:
        if self.message_id <= 0:
            raise ValueError(f"a seek to an id needs an id above 0, not {self.message_id}")


@dataclass(frozen=True, slots=True)
class ToTime:
    """Deliver again every message of the topic published at or after ``ms`` (Unix ms)."""

    ms: int


@dataclass(frozen=True, slots=True)
class ToLatest:
    """Nothing stored now waits any more: the channel delivers what is stored from now on."""


SeekTarget = Union[ToId, ToTime, ToLatest]


@dataclass(frozen=True, slots=True)
class SeekBounds:
    """The ids around a time T: every id up to ``lo`` was published before T (None: no row
    is known to be; everything is read), every id from ``hi`` on at or after it (None: no
    row is known to be)."""

    lo: int | None
    hi: int | None


@dataclass(frozen=True, slots=True)
class ArchiveGap:
    """What a seek ``--from-archive`` could not deliver from the store: the messages published
    in ``[since_ms, until_ms)`` (until_ms: the retained start the channel was sought to), to
    be re-injected for the channel from the archive at ``location``."""

    since_ms: int
    until_ms: int
    location: str


@dataclass(frozen=True, slots=True)
class Sought:
    """What a seek did (or, a dry run, would do).

    ``count``: the channel's copies waiting right after the seek, of ids up to ``top`` (the
    topic's highest id the seek read; None: the topic has nothing stored). ``target_id`` and
    ``target_ms``: the first of them (the lowest id) and its publish time, None when there is
    none. ``epoch``: the channel's new epoch, None for a dry run. ``previous_id`` and
    ``previous_ms``: the lowest copy waiting before the seek and its publish time (None: none
    waited). ``gap``: a seek ``--from-archive`` before the retained start, what is left to
    re-inject from the archive (``target`` is then the retained start); None otherwise."""

    target: SeekTarget
    count: int
    top: int | None
    target_id: int | None
    target_ms: int | None
    epoch: int | None
    previous_id: int | None
    previous_ms: int | None
    gap: ArchiveGap | None = None


class SeekRefused(ValueError):
    """A seek that cannot be done as asked; the message says why."""


class NoSuchChannel(SeekRefused):
    def __init__(self, topic: str, channel: str) -> None:
        super().__init__(f"no such channel: {topic}/{channel} is not registered")
        self.topic, self.channel = topic, channel


class BeforeRetainedStart(SeekRefused):
    """The target lies where the retention sweep already removed messages."""

    def __init__(self, topic: str, swept_ms: int, swept_id: int, oldest_id: int | None, oldest_ms: int | None) -> None:
        oldest = ("nothing of it is stored now" if oldest_id is None
                  else f"the oldest retained message (id {oldest_id}) was published at {iso_ms(oldest_ms)}")
        super().__init__(
            f"topic {topic} keeps nothing published at or before {iso_ms(swept_ms)} (id {swept_id}): {oldest}; "
            "seek to a later time, or re-inject the gap from the archive (--from-archive)")
        self.topic, self.swept_ms, self.swept_id = topic, swept_ms, swept_id
        self.oldest_id, self.oldest_ms = oldest_id, oldest_ms


class NotArchived(SeekRefused):
    """A seek ``--from-archive`` before the retained start of a database that has no archive."""

    def __init__(self, topic: str, swept_ms: int) -> None:
        super().__init__(
            f"topic {topic} keeps nothing published at or before {iso_ms(swept_ms)}, and this database has "
            "no archive to re-inject it from (`dmq-pipeline archive` was never run on it)")
        self.topic, self.swept_ms = topic, swept_ms


class SeekInFuture(SeekRefused):
    def __init__(self, ms: int, now_ms: int) -> None:
        super().__init__(f"cannot seek to {iso_ms(ms)}: it is after now ({iso_ms(now_ms)})")
        self.ms, self.now_ms = ms, now_ms


class PastTimeToLive(SeekRefused):
    """On a topic with a time to live, the replay of a message older than it would be
    dead-lettered at once (``expire_deliveries``)."""

    def __init__(self, topic: str, ms: int, ttl_ms: int, now_ms: int) -> None:
        super().__init__(
            f"cannot seek topic {topic} to {iso_ms(ms)}: its messages expire after {ttl_ms} ms, so nothing "
            f"published before {iso_ms(now_ms - ttl_ms)} would be delivered again")
        self.topic, self.ms, self.ttl_ms = topic, ms, ttl_ms


def iso_ms(ms: int | None) -> str:
    """Unix ms as RFC 3339 UTC with milliseconds (no datetime: times before 1970 too)."""
    if ms is None:
        return "unknown"
    seconds, millis = divmod(ms, 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


class _Search:
    """One side of the search of a time: ``good`` is a point whose row was found on the
    wanted side (``row``: that row's id), ``bad`` one whose row was not (or past the
    ids). The interval between them narrows by halves; the row found at a point stands
    for every point from it up to its id."""

    def __init__(self, good: int, bad: int, row: int) -> None:
        self.good, self.bad, self.row = good, bad, row

    def midpoint(self) -> int | None:
        return (self.good + self.bad) // 2 if abs(self.bad - self.good) > 1 else None

    def narrow(self, mid: int, found: int | None, wanted: bool, upward: bool) -> None:
        """``upward``: the good point is below the bad one (the search of ``lo``)."""
        if wanted and found is not None:
            # (min, max: a row deleted meanwhile, of another topic, cannot turn the interval over)
            self.good, self.row = (min(found, self.bad - 1) if upward else mid), found
        else:
            self.bad = mid if upward or found is None else min(found, self.good - 1)


def seek_bounds_steps(ms: int, skew_ms: int = SEEK_SKEW_MS, high: bool = True) -> Steps[SeekBounds]:
    """The ids around time ``ms`` (``SeekBounds``), by a binary search of the primary key: a
    probe (``seek_probe``) answers the first row at or after a point and its publish time;
    ``lo`` is a row published at or before ms - skew, ``hi`` a row published at or after
    ms + skew, each found near the id where the publish times cross that time. Publish
    times follow ids only roughly (the skew), so neither is the extreme row: what matters
    is each one's own time, tested on its row. Both searches advance in one statement a
    step (about 48 steps in a cluster's id slot). Without ``high`` only ``lo`` is looked for
    (``hi`` None), as the retention sweep's first pass needs."""
    ((lowest, highest),) = yield Statement("seek_ends", {})
    if lowest is None:
        return SeekBounds(None, None)
    early_us, late_us = (ms - skew_ms) * 1000, (ms + skew_ms) * 1000
    ((_, low_id, low_us), (_, high_id, high_us)) = yield Statement("seek_probe", {"at": [lowest, highest]})
    # lo: from the lowest row up, if it is early enough; hi: from the highest down, if late enough
    lo = _Search(lowest, highest + 1, low_id) if low_us is not None and low_us <= early_us else None
    hi = _Search(highest, lowest - 1, high_id) if high and high_us is not None and high_us >= late_us else None
    while True:
        lo_mid = lo.midpoint() if lo is not None else None
        hi_mid = hi.midpoint() if hi is not None else None
        points = [p for p in (lo_mid, hi_mid) if p is not None]
        if not points:
            return SeekBounds(lo.row if lo is not None else None, hi.row if hi is not None else None)
        answers = {at: (found, us) for at, found, us in (yield Statement("seek_probe", {"at": points}))}
        if lo is not None and lo_mid is not None:
            found, us = answers[lo_mid]
            lo.narrow(lo_mid, found, us is not None and us <= early_us, upward=True)
        if hi is not None and hi_mid is not None:
            found, us = answers[hi_mid]
            hi.narrow(hi_mid, found, us is not None and us >= late_us, upward=False)


def seek_channel_steps(topic: str, channel: str, target: SeekTarget, dry_run: bool = False,
                       skew_ms: int = SEEK_SKEW_MS, fresh: bool = False,
                       from_archive: bool = False) -> Steps[Sought]:
    """Seek ``channel`` of ``topic`` to ``target`` (run in one transaction: a ``DbWorker``'s,
    or ``conn.transaction()``); with ``dry_run`` the same answer, nothing written. Refused
    (``SeekRefused``): a channel not registered, a time after now, a time before a topic's
    time to live reaches, a target where the retention sweep already removed messages
    (``dmq_retention``: exact, it is the newest row deleted). ``fresh``: the channel was
    registered by this transaction, so its epoch stays (``start_channel_steps``).
    ``from_archive``: a time before the retained start seeks to the retained start and
    returns the gap (``Sought.gap``; refused, ``NotArchived``, without an archive)."""
    yield Statement("seek_lock", {"topic": topic})
    ((registered, ttl_ms, swept_id, swept_ms, now_ms, oldest_id, oldest_ms, archive),) = yield Statement(
        "seek_state", {"topic": topic, "channel": channel})
    if not registered:
        raise NoSuchChannel(topic, channel)
    gap = None
    params: dict[str, object] = {"topic": topic, "channel": channel, "dry_run": dry_run, "latest": False,
                                 "floor": None, "window_hi": None, "before_ms": None, "fresh": fresh}
    if isinstance(target, ToTime):
        if target.ms > now_ms:
            raise SeekInFuture(target.ms, now_ms)
        if ttl_ms is not None and target.ms < now_ms - ttl_ms:
            raise PastTimeToLive(topic, target.ms, ttl_ms, now_ms)
        if swept_ms is not None and target.ms <= swept_ms:
            if not from_archive:
                raise BeforeRetainedStart(topic, swept_ms, swept_id, oldest_id, oldest_ms)
            if archive is None:
                raise NotArchived(topic, swept_ms)
            gap = ArchiveGap(target.ms, swept_ms + 1, archive)
            target = ToTime(swept_ms + 1)
        bounds = yield from seek_bounds_steps(target.ms, skew_ms)
        params.update(floor=0 if bounds.lo is None else bounds.lo, window_hi=bounds.hi, before_ms=target.ms)
    elif isinstance(target, ToId):
        if swept_id is not None and target.message_id <= swept_id:
            if from_archive:  # the archive's gap is a range of publish times
                raise SeekRefused(f"topic {topic} keeps no message at or below id {swept_id}: --from-archive "
                                  f"takes a time (--to-time, --by), the gap is read by publish time")
            raise BeforeRetainedStart(topic, swept_ms, swept_id, oldest_id, oldest_ms)
        params.update(floor=target.message_id - 1)
    else:
        params.update(latest=True)
    rows = yield Statement("seek_channel", params)
    if not rows:  # removed since seek_state read it
        raise NoSuchChannel(topic, channel)
    ((count, top, first_id, first_ms, epoch, previous_id, previous_ms),) = rows
    return Sought(target, int(count), top, first_id, first_ms, epoch, previous_id, previous_ms, gap)


def start_channel_steps(spec: TopicSpec, channel: str, target: SeekTarget, dry_run: bool = False) -> Steps[Sought]:
    """A channel that starts in the past (``dmq channel add T C --start-time``): make this
    cluster's database hold the topic and ``channel`` as the registry does (``spec``, read
    from it; the mirror every node runs, idempotent and without removals, so a row a node
    mirrored first stays), then seek ``channel`` to ``target``, in one transaction.

    Why not wait for a node's mirror: with ZooKeeper a cluster's rows are written only
    while a node runs, and none may (the CLI needs no server); a mirror that comes after
    this one finds the rows and changes nothing. When this transaction inserts the
    channel's row (no node has read it yet), the seek keeps its epoch at 0: a node that
    opens the channel reads the sought cursors at once, and learning of a new epoch later
    would make it deliver them all again. Refused as ``seek_channel_steps``."""
    if channel not in spec.channels:
        spec = dataclasses.replace(spec, channels=tuple(sorted((*spec.channels, channel))))
    mirrored = yield from mirror_topics_steps([spec], removals=False)
    fresh = (spec.name, channel) in mirrored.added
    return (yield from seek_channel_steps(spec.name, channel, target, dry_run, fresh=fresh))

"""A channel's delivery cursor on this node: what is read, what is done, what a restart loads.

PostgreSQL keeps a channel's progress over the messages of each owner (the incarnation
that stored them) as one ``dmq_cursor`` row: a floor (every id up to it done) and the
ids done above it (``sql/migrations/0007_cursors.sql``). The node delivering those
copies is the only one that knows how far that row may move, because only it knows
which copies it holds: ``ChannelCursor`` is that knowledge for one channel, every owner
of it, kept in memory and free of IO (the channel calls it; the store hands its
proposals to the ack statement, which merges them: a floor only rises, done ranges only
grow). Its state:

- ``position``: how far the channel has read its copies (a load asks for ids after it;
  a copy committed at or below it is kept in memory, since no later load finds it) and
  ``backlog``: PostgreSQL may hold copies after it that memory does not. Every copy at or
  below the position is held or done: what the proposal's floor rests on. A copy may be
  set aside (``left_stored``: a higher priority took its place in the window), and the
  position then goes back below it;
- the priority read-ahead (``urgent``, ``ahead``): copies of priority 1 to 9 are read
  ahead of the position, highest first (``lookahead_from``, then ``loaded``), so a
  waiting copy of a higher priority never waits behind the id order of lower ones.
  ``urgent``: the levels PostgreSQL may still hold copies of beyond the reads;
  ``ahead[p]``: how far level ``p`` has been read ahead (every copy of it between the
  position and there is held or done). The read-ahead never moves the position, so the
  floor never rests on it;
- the keys read apart (``skipped``, an ordered topic's channel): a key with more copies
  waiting than a share of the window leaves memory but for its first few; loads leave
  its copies out and move past them, and the channel reads them one key at a time
  (``key_load_from``). What is skipped is the exception to the rule above: every copy up
  to the position is held or done, or of a skipped key at or above its id here, so the
  proposal stays below the lowest of those;
- ``known``: the ids held (ready, in flight) or awaiting a durable outcome, so a load
  never brings back a copy this node still holds or has just acknowledged;
- ``early``: this node's own copies a load read before their commit was answered (above
  ``OwnWrites.horizon``), so the answer's arrival never pushes again a copy the load's
  went out as, acknowledged and made durable meanwhile (at least once would allow it; a
  key's order on an ordered topic would not);
- ``finishing``: the ids acknowledged, or handed to their dead letter, whose statement
  has not committed yet, with their owner: holes in every proposal until then;
- a load's races: copies committed while it was out (``arrived``), and ids finished
  while it was out, which its snapshot may still hold (``dropped``); and the two
  ownership changes that may meet a load: a takeover (``rescan``: read again from the
  first id after it) and a lost session (``forget``: the load's rows are stale);
- ``loads_only``: the channel of an ordered topic this node delivers for the whole
  cluster (its orderer). Every node stores the topic, and only the loads see the copies
  of the others, read with every owner's. The topic's commits are serialised across the
  nodes, so its ids become visible in order: a load that read up to an id saw every copy
  below it. An arrival (this node's own commit) therefore never moves the position, where
  another node's lower copy may still be unread: at or below the position a load read it
  already (one not held now was acknowledged, and pushing it again would be a duplicate),
  above it the next load reads it (``backlog``).

What the proposal may cover of an owner is bounded by how far that owner's ids are
settled (``reliable.horizon.OwnWrites``, one per store: it spans every channel). The
fence (in a cluster a cursor moves only while this node holds it) is the ack
statement's; what the cursor does with a refused ack is ``refused``.

The shape is that of a managed cursor (Pulsar's read position, mark-delete position and
individually deleted ranges), computed from memory when a batch of acks is made durable
instead of kept as ranges: a channel's holes are few (what is in flight), its acks many.

Why one long module: the proposal is safe only because of how the loads, the read-ahead
and the copies set aside move the position; those rules and the proposal are one
invariant (every copy up to the position is held or done), read together.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Callable, Generic, Iterable, Mapping, Protocol, Sequence, TypeVar

from dmq_server.db.messages import NOTHING_AHEAD, AckRun, BacklogRow

__all__ = ["ChannelCursor", "Copy", "LEVELS", "NOTHING_AHEAD", "acks_by_cursor", "split_fenced"]


class _Stored(Protocol):
    @property
    def message_id(self) -> int: ...
    @property
    def owner(self) -> int: ...
    @property
    def priority(self) -> int: ...
    @property
    def key(self) -> str | None: ...


class Copy(Protocol):
    """What the cursor reads of a channel's copy (``reliable.channel.Delivery``, which
    imports this module): its message's id, owner, priority and key."""

    @property
    def message(self) -> _Stored: ...


# the channel's copies: the cursor holds them and hands them back to the channel
CopyT = TypeVar("CopyT", bound=Copy)

#: the priorities read ahead of the position (0, every message without one, is read in id order)
LEVELS = range(1, 10)


class ChannelCursor(Generic[CopyT]):
    """The delivery state of one channel on this node (every owner's copies)."""

    __slots__ = ("position", "backlog", "loading", "known", "finishing", "arrived", "dropped",
                 "rescan_pending", "load_stale", "urgent", "ahead", "skipped", "key_after", "loads_only",
                 "early")

    def __init__(self) -> None:
        self.position = 0
        # Start assuming the database holds copies not seen yet (restart, takeover), of
        # every priority: only ever a level with ``backlog`` set too
        self.backlog = True
        self.urgent: set[int] = set(LEVELS)
        # by priority; [0]: how far the keys read apart were read (level 0 is read at the position)
        self.ahead = [0] * 10
        self.skipped: dict[str, int] = {}  # key -> the lowest id of its copies left stored
        self.key_after = 0  # the id a key's read out now reads after
        self.loading = False
        self.known: set[int] = set()
        self.finishing: dict[int, int] = {}  # id -> owner, until its durable outcome
        self.arrived: list[CopyT] = []  # Deliveries committed while a load was out
        self.dropped: set[int] = set()  # finished while a load was out: keep them out of it
        # own copies a load read before their commit's answer came: the answer's ``add``
        # finds them here and hands on nothing (the load's copy went out, or waits)
        self.early: set[int] = set()
        self.rescan_pending = False  # a takeover during a load: read from the first id after it
        self.load_stale = False  # a lost session during a load: discard its rows
        self.loads_only = False  # an ordered topic's orderer in a cluster: arrivals are read by loads

    # -- acknowledgements and their durable outcome --------------------------------------
    def acknowledged(self, deliveries: Sequence[CopyT]) -> None:
        """Consumers acknowledged these copies (out of flight now): holes in every
        proposal until their durable ack commits. They stay ``known``, so a load cannot
        resurrect them. Runs once per acknowledged copy (bench/channel_cost.py)."""
        finishing = self.finishing
        for delivery in deliveries:
            message = delivery.message
            finishing[message.message_id] = message.owner

    def exhausted(self, message_id: int, owner: int) -> None:
        """The copy had its attempts: it awaits its dead letter as an ack awaits its row."""
        self.finishing[message_id] = owner

    def durable(self, message_ids: Iterable[int], in_flight: Mapping[int, CopyT]) -> None:
        """Their durable ack (or dead letter) committed: done, and no longer held. A copy
        in flight again (a newer delivery of the same id) keeps its place."""
        known, finishing = self.known, self.finishing
        for mid in message_ids:
            if mid not in in_flight:
                known.discard(mid)
                finishing.pop(mid, None)
                if self.loading:
                    # its row is done now, but the load under way may have read it
                    # first (a rescan reads ids it delivered before): keep it out
                    self.dropped.add(mid)

    def refused(self, message_ids: Iterable[int], in_flight: Mapping[int, CopyT]) -> None:
        """The fence refused their durable ack: another node holds their cursor now and
        delivers them (a batch that fails is retried, and its copies stay finishing).
        Forgotten here, so their next delivery is a redelivery: at least once."""
        known, finishing = self.known, self.finishing
        for mid in message_ids:
            if mid not in in_flight:
                known.discard(mid)
                finishing.pop(mid, None)

    def drop(self, gone: set[int]) -> set[int]:
        """Copies whose stored state is gone (expired into dead letters): out of the
        cursor and of a load under way. Returns those that were held."""
        if self.loading:  # the load's snapshot may predate the delete: keep them out
            self.dropped |= gone
            self.arrived = [d for d in self.arrived if d.message.message_id not in gone]
        known, finishing = self.known, self.finishing
        ids = {mid for mid in gone if mid in known}
        for mid in ids:
            known.discard(mid)
            finishing.pop(mid, None)
        return ids

    # -- loads ----------------------------------------------------------------------------
    def load_from(self) -> int:
        """A load goes out: the id after which it reads."""
        self.loading = True
        return self.position

    def loaded(
        self,
        rows: Iterable[BacklogRow],
        limit: int,
        enqueue_row: Callable[[BacklogRow], None],
        enqueue: Callable[[CopyT], None],
        room: Callable[[CopyT], bool],
        *,
        ahead: bool = False,
        key: str | None = None,
        room_ahead: Callable[[CopyT], bool] | None = None,
    ) -> bool:
        """A load's ``rows`` arrived (in id order, at most ``limit``), or with ``ahead`` a
        read-ahead's (highest priority first, then by id). False, with the rows dropped
        and the cursor back at the first id, when a ``forget`` made them stale.
        Otherwise each row not held nor finished meanwhile goes to ``enqueue_row``; the
        copies committed meanwhile go to ``enqueue`` when at or below the position (no
        later load would find them) or when nothing waits in PostgreSQL and the window
        has ``room``, or, of a priority, when ``room_ahead`` keeps it in memory above the
        position (as ``add`` would have had no load been out), else back to the backlog; a
        takeover met meanwhile starts the next load from the first id.

        A load moves the position to its last row, and leaves out the rows of a key
        skipped meanwhile (they wait for that key's read); a read-ahead leaves the
        position and reads each level as far as its last row of that level: with fewer
        than ``limit`` rows every level asked for is read to its end, else every level
        above the last row's. A ``key``'s read (``key_load_from``) leaves the position too:
        with fewer than ``limit`` rows the key is read to its end and no longer skipped."""
        self.loading = False
        dropped, self.dropped = self.dropped, set()
        if self.load_stale:
            self.load_stale = False
            self.restart()
            return False
        known, levels, skipped = self.known, self.ahead, self.skipped
        count = level = last = 0
        for row in rows:
            count += 1
            mid = row.message_id
            if ahead:
                level = row.priority
                if mid > levels[level]:
                    levels[level] = mid
            elif key is not None:
                last = mid
                if mid > levels[0]:
                    levels[0] = mid
            else:
                if mid > self.position:
                    self.position = mid
                if skipped and row.key in skipped and mid not in known and mid not in dropped:
                    self.skip(row.key, mid)  # skipped while the load was out: read with its key
                    continue
            if mid in known or mid in dropped:
                continue
            enqueue_row(row)
        if key is not None:
            # a copy of the key set aside while the read was out, at or below where it
            # read from, keeps the key skipped from there
            if key in skipped and skipped[key] > self.key_after:
                if count >= limit:
                    skipped[key] = last + 1
                else:
                    del skipped[key]
                    if not skipped and self.loads_only:
                        # other nodes' copies committed since the last load may lie below
                        # the key's last: the next load passes it
                        self.backlog = True
                    elif not skipped and not self.backlog:  # everything is read: pass it
                        self.position = max(self.position, *levels)
        elif ahead:
            self.urgent.difference_update(range(level + 1, 10) if count >= limit else LEVELS)
        elif count < limit:
            # the table had nothing more when it was read (of any priority); later
            # arrivals were kept aside. What was read ahead is held or done: the position
            # passes it (else the floor would wait for the next message to pass it)
            self.backlog = False
            self.urgent.clear()
            self.position = max(self.position, *levels)
        self._settle(enqueue, room, room_ahead)
        return True

    def _settle(
        self,
        enqueue: Callable[[CopyT], None],
        room: Callable[[CopyT], bool],
        room_ahead: Callable[[CopyT], bool] | None,
    ) -> None:
        """The copies committed while a load was out go to ``enqueue`` when at or below the
        position or when nothing waits in PostgreSQL and the window has ``room``; a copy of
        a priority whose level ``room_ahead`` keeps in memory (it may set aside lower
        copies for it) waits there above the position (``kept_ahead``); the rest wait in
        PostgreSQL (``loads_only``: they are left to the loads). A takeover met meanwhile
        starts the next load from the first id."""
        arrived, self.arrived = self.arrived, []
        for delivery in arrived:
            message = delivery.message
            mid = message.message_id
            if mid in self.known:
                continue
            if self.skipped and message.key in self.skipped:
                self.skip(message.key, mid)
            elif self.loads_only:  # read by this load or an earlier one, or by the next
                if mid > self.position:
                    self.left_stored(mid, message.priority)
            elif mid <= self.position:
                enqueue(delivery)
            elif not self.backlog and room(delivery):
                self.position = mid  # nothing older waits in PostgreSQL (as ``add`` keeps one)
                enqueue(delivery)
            elif message.priority and room_ahead is not None and room_ahead(delivery):
                self.kept_ahead(mid, message.priority)
                enqueue(delivery)
            else:
                self.left_stored(mid, message.priority)
        if self.rescan_pending:
            self.rescan_pending = False
            self.from_start()

    def lookahead_from(self) -> list[int]:
        """A read-ahead goes out (``urgent`` is not empty): for each priority 1 to 9, the
        id after which it reads that level (``NOTHING_AHEAD`` for a level with nothing
        left to read)."""
        self.loading = True
        position, ahead, urgent = self.position, self.ahead, self.urgent
        return [max(position, ahead[p]) if p in urgent else NOTHING_AHEAD for p in LEVELS]

    def key_load_from(self, key: str) -> int:
        """A skipped ``key``'s read goes out: the id after which it reads its copies."""
        self.loading = True
        self.key_after = self.skipped[key] - 1
        return self.key_after

    def skip(self, key: str, message_id: int) -> None:
        """A copy of ``key`` stays stored, to be read with its key (an ordered topic's key
        with many copies waiting): loads leave the key out from now on, and the proposal
        stays below it."""
        lowest = self.skipped.get(key)
        if lowest is None or message_id < lowest:
            self.skipped[key] = message_id

    def unskip(self) -> None:
        """Every key is read with the others again (the topic is no longer ordered): the
        position goes back under the lowest copy left stored."""
        if self.skipped:
            self.position = min(self.position, min(self.skipped.values()) - 1)
            self.backlog = True
            self.skipped.clear()

    def kept_ahead(self, message_id: int, priority: int) -> None:
        """A copy of a priority whose level waits nowhere in PostgreSQL stays in memory
        above the position: its level is read as far as it."""
        if message_id > self.ahead[priority]:
            self.ahead[priority] = message_id

    def left_stored(self, message_id: int, priority: int) -> None:
        """A copy stays in PostgreSQL, not in memory (the window had no room for it, or a
        higher priority took its place): the reads must come back to it. Below the
        position, the position goes back under it (every copy up to the position is held
        or done: what the floor rests on); of a priority, its level is read ahead again
        from under it."""
        if message_id <= self.position:
            self.position = message_id - 1
        self.backlog = True
        if priority > 0:
            self.urgent.add(priority)
            if message_id <= self.ahead[priority]:
                self.ahead[priority] = message_id - 1

    def load_failed(self, enqueue: Callable[[CopyT], None]) -> None:
        """The load failed (storage error): the backlog stays, a later load retries. Copies
        committed meanwhile at or below the position go to ``enqueue``: a later load
        starts after the position and would never see them."""
        self.loading = False
        self.backlog = True
        self.dropped = set()
        if self.load_stale:
            self.load_stale = False
            self.restart()
            return
        arrived, self.arrived = self.arrived, []
        for delivery in arrived:
            mid = delivery.message.message_id
            # (``loads_only``: an earlier load read those at or below the position)
            if mid <= self.position and mid not in self.known and not self.loads_only:
                enqueue(delivery)
        if self.rescan_pending:
            self.rescan_pending = False
            self.from_start()

    # -- ownership changes (cluster takeover, lost session, an emptied channel) ------------
    def rescan(self) -> bool:
        """Copies not seen here may now sit below the position (a takeover gave this node
        another node's copies): read again from the first id; copies held are skipped by
        ``known``. False while a load is out: its answer starts the next from the first id."""
        if self.loading:
            self.rescan_pending = True
            return False
        self.from_start()
        return True

    def forget(self, held: set[int]) -> None:
        """Nothing of ``held`` (the copies ready or in flight) is this node's any more
        (its session was lost: a takeover may have moved them): read everything again
        from the first id. What is finishing stays ``known`` until its outcome; a load
        out now is stale."""
        self.known -= held
        if self.loading:
            self.load_stale = True
        self.restart()

    def reseek(self) -> None:
        """A seek rewrote the channel's cursors (issue 46; after ``forget``): nothing this
        node knew of the channel holds any more. Not even what is finishing: a copy whose
        ack is still being made durable may be the seek's to deliver again (its ack is
        refused by the epoch), and kept ``known`` it would be skipped by the next load and
        never pushed again; an outcome that arrives later is ignored by the store (its
        epoch is older)."""
        self.known.clear()
        self.finishing.clear()
        self.dropped = set()
        if self.loading:
            self.load_stale = True
        self.restart()

    def restart(self) -> None:
        """Read again from the first id; copies committed during a load are stored and
        owned here, so that read finds them."""
        self.rescan_pending = False
        self.arrived = []
        self.from_start()

    def from_start(self) -> None:
        """The next load reads from the first id, every priority level too (it notes
        again what it reads early)."""
        self.early.clear()
        self.position = 0
        self.backlog = True
        self.urgent = set(LEVELS)
        self.ahead = [0] * 10
        self.skipped.clear()

    def close(self) -> None:
        """The channel was unregistered."""
        self.finishing.clear()
        self.known.clear()

    # -- the proposal ---------------------------------------------------------------------
    def progress(
        self,
        owner: int,
        acked: Iterable[int],
        limit: float | None,
        in_flight: Mapping[int, CopyT],
        lowest_ready: int | None,
    ) -> tuple[int, list[tuple[int, int]]]:
        """What is known to be done of ``owner``'s copies: a floor (every id up to it)
        and inclusive spans above it covering ``acked`` (the acks being made durable
        now). ``limit``: how far ``owner``'s ids are settled (``reliable.horizon``);
        None: nothing is, so only the acks themselves. ``in_flight``: the channel's
        copies out to consumers (Deliveries by id); ``lowest_ready``: the owner's lowest
        id waiting in memory.

        Every copy with an id up to ``bound`` (the least of ``limit``, the position, and
        one below the lowest ready copy) is in memory or done: loads go in id order, a
        late commit at or below the position is kept, and the horizon holds back ids of
        writes not yet handed over. So the holes are the copies in flight, finishing
        (other than ``acked``), or set aside by a load; everything else up to the bound
        is done, whatever ids of other topics or owners lie between."""
        points = sorted(set(acked))
        if limit is None:
            return 0, [(x, x) for x in points]
        position = 0 if (self.rescan_pending or self.load_stale) else self.position
        ceiling = min(limit, position)  # a float: limit may be infinite
        if self.skipped:
            ceiling = min(ceiling, min(self.skipped.values()) - 1)
        if lowest_ready is not None:
            ceiling = min(ceiling, lowest_ready - 1)
        bound = int(ceiling)
        done = set(points)
        holes = [mid for mid, d in in_flight.items() if mid <= bound and d.message.owner == owner]
        holes += [mid for mid, o in self.finishing.items() if o == owner and mid <= bound and mid not in done]
        holes += [
            d.message.message_id for d in self.arrived
            if d.message.owner == owner and d.message.message_id <= bound
        ]
        holes.sort()
        floor = holes[0] - 1 if holes else bound
        spans: list[tuple[int, int]] = []
        for x in points:
            if x <= floor:
                continue
            if x <= bound:
                i = bisect_left(holes, x)
                span = (holes[i - 1] + 1 if i else floor + 1, holes[i] - 1 if i < len(holes) else bound)
            else:
                span = (x, x)
            if not spans or spans[-1] != span:
                spans.append(span)
        return floor, spans


# -- a batch of durable acks, over every channel -------------------------------------------
def acks_by_cursor(runs: Iterable[AckRun]) -> dict[tuple[str, str, int], list[int]]:
    """The acks of a batch (``db.messages.AckRun``s) by the cursor they move: (topic,
    channel, owner) -> ids, in the order acknowledged."""
    acked: dict[tuple[str, str, int], list[int]] = {}
    for run in runs:
        owner = run.single_owner()
        if owner is not None:
            acked.setdefault((run.topic, run.channel, owner), []).extend(run.message_ids)
            continue
        for mid, owner in zip(run.message_ids, run.owners):
            acked.setdefault((run.topic, run.channel, owner), []).append(mid)
    return acked


def split_fenced(
    runs: Iterable[AckRun], taken: Iterable[tuple[str, str, int]]
) -> tuple[dict[tuple[str, str], list[int]], dict[tuple[str, str], list[int]]]:
    """A committed batch's acks by channel: those applied (durable), and those the fence
    refused because another node holds their cursor (``taken``: (topic, channel, owner))."""
    applied: dict[tuple[str, str], list[int]] = {}
    refused: dict[tuple[str, str], list[int]] = {}
    fenced = set(taken)
    for run in runs:
        key = (run.topic, run.channel)
        if not fenced:
            applied.setdefault(key, []).extend(run.message_ids)
            continue
        for mid, owner in zip(run.message_ids, run.owners):
            into = refused if (run.topic, run.channel, owner) in fenced else applied
            into.setdefault(key, []).append(mid)
    return applied, refused

"""What every admin surface shares of a seek (``dmq channel seek``, the admin API, the
console): reading the target an operator names, and saying what the seek did.

A seek rewinds (or forwards) one channel of a topic to a time, an id, or the latest
message, on every PostgreSQL cluster (``db.seek.seek_channel_steps``, one transaction per
cluster); every node learns of it at its next channel-state read (``--channel-state-
interval``), or at once when an ack of its is refused, and delivers the channel's copies
again from the target. The target is absolute, as Kafka's and Pulsar's resets are:
everything before it is done for the channel, copies waiting included.

``--from-archive`` (``from_archive=true``): a time before the topic's retained start seeks the
channel to that start, and the answer names the ``dmq-pipeline reinject`` command that queues
the gap from the archive for the channel (``reinject_command``). The seek does not run it: the
pipeline is a distribution of its own, on Spark, which a dmq server does not depend on.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import fields
from typing import Mapping

from dmq_client.spelling import parse_duration, parse_time_ms
from dmq_server.core.errors import Invalid
from dmq_server.db.messages import MAX_ID
from dmq_server.db.seek import ArchiveGap, SeekTarget, Sought, ToId, ToLatest, ToTime, iso_ms as _iso

__all__ = ["SEEK_KEYS", "parse_seek", "parse_flag", "describe_target", "describe_seek", "reinject_command",
           "report", "summary"]

#: the keys that name a target; exactly one is given
SEEK_KEYS = ("to_time", "to_id", "by", "to_latest")


def parse_seek(params: Mapping[str, str | None], now_ms: int | None = None) -> SeekTarget:
    """The target named by exactly one of ``SEEK_KEYS``: ``to_time`` (Unix ms, ISO 8601, or
    a duration ago: ``1h``), ``to_id`` (a message id), ``by`` (a shift back from now:
    ``-1h``), ``to_latest`` (true: skip what waits). ``Invalid`` says what is wrong."""
    given = {key: value for key, value in params.items() if value not in (None, "", False)}
    unknown = sorted(set(given) - set(SEEK_KEYS))
    if unknown:
        raise Invalid(f"unknown seek target {unknown[0]!r}: name one of {', '.join(SEEK_KEYS)}")
    if len(given) != 1:
        raise Invalid(f"a seek needs one target, {' or '.join(SEEK_KEYS)}; got "
                      + (", ".join(sorted(given)) if given else "none"))
    ((key, value),) = given.items()
    text = str(value)
    if key == "to_time":
        try:
            return ToTime(parse_time_ms(text, now_ms))
        except ValueError as exc:
            raise Invalid(f"to_time: {exc}") from None
    if key == "by":
        if not text.startswith("-"):
            raise Invalid(f"by: {text!r} does not go back: a seek by a duration goes back from now (-1h)")
        try:
            back_ms = int(parse_duration(text[1:]) * 1000)
        except ValueError as exc:
            raise Invalid(f"by: {exc}") from None
        ms = (int(time.time() * 1000) if now_ms is None else now_ms) - back_ms
        if ms < 0:
            raise Invalid(f"by: {text} goes back before 1970")
        return ToTime(ms)
    if key == "to_id":
        if not text.isdigit() or not 1 <= int(text) <= MAX_ID:
            raise Invalid(f"to_id: {text!r} is not a message id (a positive integer below 2^63)")
        return ToId(int(text))
    if text.lower() not in ("true", "1", "yes"):
        raise Invalid(f"to_latest: expected true, got {text!r}")
    return ToLatest()


def parse_flag(name: str, value: str | None) -> bool:
    """A true/false query parameter of the admin API (absent: false)."""
    text = (value or "false").lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise Invalid(f"{name}: expected true or false, got {value!r}")


def describe_target(target: SeekTarget) -> str:
    if isinstance(target, ToTime):
        return f"time {_iso(target.ms)}"
    if isinstance(target, ToId):
        return f"id {target.message_id}"
    return "the latest message"


def describe_seek(topic: str, channel: str, requested: SeekTarget, sought: list[Sought]) -> str:
    """The audit entry's selection: the channel and the target asked for, and for a seek
    ``--from-archive`` that fell before the retained start, where it was sought instead."""
    text = f"{topic}/{channel} to {describe_target(requested)}"
    gaps = [s for s in sought if s.gap is not None]
    if gaps:
        text += ", from archive: sought to " + ", ".join(describe_target(s.target) for s in gaps)
        text += ", gap left to dmq-pipeline reinject"
    return text


def reinject_command(topic: str, channel: str, gap: ArchiveGap) -> str:
    """The ``dmq-pipeline reinject`` command that queues a seek's gap for the channel (run it
    against the same database: ``--pg-dsn``, or ``--data-path`` of an embedded one)."""
    return " ".join(shlex.quote(word) for word in (
        "dmq-pipeline", "reinject", "--archive", gap.location, "--topic", topic, "--channel", channel,
        "--since", _iso(gap.since_ms), "--until", _iso(gap.until_ms)))


def report(cluster: str, sought: Sought, dry_run: bool, topic: str = "", channel: str = "") -> dict[str, object]:
    """A seek's answer on one cluster, as JSON (the admin API, ``--json``): the cluster,
    whether it was a dry run, and the fields of ``Sought`` but the target; the gap of a seek
    ``--from-archive`` as ``from_archive`` with its ``reinject`` command (absent otherwise)."""
    answer: dict[str, object] = {
        "cluster": cluster, "dry_run": dry_run,
        **{f.name: getattr(sought, f.name) for f in fields(Sought) if f.name not in ("target", "gap")}}
    if sought.gap is not None:
        answer["from_archive"] = {
            "since_ms": sought.gap.since_ms, "until_ms": sought.gap.until_ms, "archive": sought.gap.location,
            "reinject": reinject_command(topic, channel, sought.gap)}
    return answer


def summary(topic: str, channel: str, cluster: str, sought: Sought, dry_run: bool) -> str:
    """One line: what the seek made the channel's to deliver (or would, a dry run), from
    where, and where the channel was."""
    what = f"{topic}/{channel} to {describe_target(sought.target)}"
    if sought.count:
        first = f"from id {sought.target_id} ({_iso(sought.target_ms)})"
        copies = f"{sought.count} message{'s' if sought.count != 1 else ''} {first} to id {sought.top}"
    else:
        copies = "no message"
    was = ("nothing waited before" if sought.previous_id is None
           else f"it was at id {sought.previous_id} ({_iso(sought.previous_ms)})")
    if sought.gap is not None:
        what += f" (the retained start: nothing published before it is stored, from {_iso(sought.gap.since_ms)} on)"
    if dry_run:
        line = f"cluster {cluster}: seeking {what} would deliver {copies} again; {was} (dry run: nothing changed)"
    else:
        line = f"cluster {cluster}: sought {what}: {copies} to deliver again, epoch {sought.epoch}; {was}"
    if sought.gap is not None:
        line += (f"\n  the gap, published in [{_iso(sought.gap.since_ms)}, {_iso(sought.gap.until_ms)}), is not "
                 f"stored; queue it for {channel} from the archive with (against this cluster's database):"
                 f"\n  {reinject_command(topic, channel, sought.gap)}")
    return line


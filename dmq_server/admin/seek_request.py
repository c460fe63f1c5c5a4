"""What every admin surface shares of a seek (``dmq channel seek``, the admin API, the
console): reading the target an operator names, and saying what the seek did.

A seek rewinds (or forwards) one channel of a topic to a time, an id, or the latest
message, on every PostgreSQL cluster (``db.seek.seek_channel_steps``, one transaction per
cluster); every node learns of it at its next channel-state read (``--channel-state-
interval``), or at once when an ack of its is refused, and delivers the channel's copies
again from the target. The target is absolute, as Kafka's and Pulsar's resets are:
everything before it is done for the channel, copies waiting included.
"""

from __future__ import annotations

import time
from dataclasses import fields
from typing import Mapping

from dmq_client.spelling import parse_duration, parse_time_ms
from dmq_server.core.errors import Invalid
from dmq_server.db.messages import MAX_ID
from dmq_server.db.seek import SeekTarget, Sought, ToId, ToLatest, ToTime, iso_ms as _iso

__all__ = ["SEEK_KEYS", "parse_seek", "describe_target", "report", "summary"]

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


def describe_target(target: SeekTarget) -> str:
    if isinstance(target, ToTime):
        return f"time {_iso(target.ms)}"
    if isinstance(target, ToId):
        return f"id {target.message_id}"
    return "the latest message"


def report(cluster: str, sought: Sought, dry_run: bool) -> dict[str, object]:
    """A seek's answer on one cluster, as JSON (the admin API, ``--json``): the cluster,
    whether it was a dry run, and the fields of ``Sought`` but the target."""
    return {"cluster": cluster, "dry_run": dry_run,
            **{f.name: getattr(sought, f.name) for f in fields(Sought) if f.name != "target"}}


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
    if dry_run:
        return f"cluster {cluster}: seeking {what} would deliver {copies} again; {was} (dry run: nothing changed)"
    return f"cluster {cluster}: sought {what}: {copies} to deliver again, epoch {sought.epoch}; {was}"


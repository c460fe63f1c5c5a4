"""Confirmation when consumed in the asyncio client: ``MqClient``'s (``dmq_client.confirm``)
on the event loop.

``await client.send(message, confirm="consumed", confirm_timeout=30)`` returns a
``Confirmation``: the send's ``SendResult`` as always, and ``consumed``, an asyncio future
of the ``Consumed`` outcome (``CONSUMED``, ``DEAD_LETTERED``, ``DEADLINE``, ``LOST``, ...:
``ConsumeStatus``). The frame is ``MqClient``'s (``outgoing.send_frame`` with the deadline
as its ``credit``, docs/protocol.md §4.14), the table of watched sends is its ``Watching``
and the outcomes are its ``Consumed``: only the waiting is asyncio's.

A send answered SUCCESS is watched by the server that stored it, so its confirmation is
kept here with that server's name: the connection lost, it is ``LOST`` at once; never
answered, it is ``LOST`` ``GRACE`` seconds after its deadline (the resend task looks), so
the table holds each entry for a bounded time. A send not stored resolves ``NOT_SENT``
with its result; the client closing resolves the rest ``CLIENT_CLOSED``.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from ..confirm import GRACE, Consumed, ConsumeStatus, Watching
from ..message import SendResult
from ..wire import Frame, parse_consumed

__all__ = ["Confirmation", "Confirms"]


class Confirmation(NamedTuple):
    """What ``send(..., confirm="consumed")`` returns: ``result, consumed = await
    client.send(...)``, then ``outcome = await consumed``. ``consumed`` is a future: wait
    for it with a timeout through ``asyncio.shield`` (a timeout that cancels it loses the
    outcome); it always resolves, at the latest ``GRACE`` seconds after the deadline."""

    result: SendResult
    consumed: "asyncio.Future[Consumed]"


class _Watch:
    """One stored send whose ``SEND_CONSUMED_ACK`` is awaited."""

    __slots__ = ("key", "result", "future")

    def __init__(self, key: tuple[str, int], result: SendResult, future: "asyncio.Future[Consumed]"):
        self.key = key
        self.result = result
        self.future = future

    def outcome(self, status: ConsumeStatus, description: str) -> Consumed:
        result = self.result
        return Consumed(status, result.message.topic, self.key[1], result.message_id, description=description)


class Confirms:
    """The confirmations awaited by one client (``Sends`` owns it; every call on the loop)."""

    def __init__(self, producer_id: str):
        self.producer_id = producer_id
        self.watching: Watching[_Watch] = Watching()

    def __len__(self) -> int:
        return len(self.watching)

    def settled(self, future: "asyncio.Future[Consumed]", result: SendResult, confirm_ms: int, now: float) -> None:
        """The send's result came: stored, its server watches it until its deadline (plus
        ``GRACE``: then it is given up); not stored, there is nothing to confirm."""
        if future.done():
            return
        if not result.ok or result.server is None or result.session_id is None:
            description = result.description or result.status.value
            future.set_result(Consumed(ConsumeStatus.NOT_SENT, result.message.topic, result.session_id or 0,
                                       description=description))
            return
        watch = _Watch((result.producer or self.producer_id, result.session_id), result, future)
        self.watching.add(watch, result.server, now + confirm_ms / 1000.0 + GRACE)

    def reports(self, frames: list[Frame]) -> None:
        """``SEND_CONSUMED_ACK`` frames, read after the replies before them."""
        for frame in frames:
            report = parse_consumed(frame.status)
            for watch in self.watching.pop((frame.producer or self.producer_id, frame.session_id)):
                _resolve(watch.future, Consumed.from_report(report, frame.topic, frame.session_id, frame.message_id))

    def lost(self, server: str) -> None:
        """The connection to ``server`` was lost, and what it watched with it."""
        if len(self.watching):
            self._give_up(self.watching.on_server(server), ConsumeStatus.LOST,
                          f"the connection to {server}, which watched it, was lost; "
                          "the message is stored, its consumption is not known")

    def expired(self, now: float) -> None:
        if len(self.watching):
            self._give_up(self.watching.expired(now), ConsumeStatus.LOST,
                          f"no SEND_CONSUMED_ACK within the deadline and {GRACE:.0f}s; "
                          "the message is stored, its consumption is not known")

    def close(self) -> None:
        self._give_up(self.watching.drain(), ConsumeStatus.CLIENT_CLOSED,
                      "the client closed before the server reported the message's consumption")

    @staticmethod
    def _give_up(watches: list[_Watch], status: ConsumeStatus, description: str) -> None:
        for watch in watches:
            _resolve(watch.future, watch.outcome(status, description))


def _resolve(future: "asyncio.Future[Consumed]", outcome: Consumed) -> None:
    if not future.done():  # a caller may have cancelled it (a timeout without shield)
        future.set_result(outcome)

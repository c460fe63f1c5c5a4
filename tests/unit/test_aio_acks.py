"""The asyncio client's acks (``dmq_client.aio.subscribe``) over a fake link: held until the
end of the loop's turn and written as one ``UP_CONSUMER_ACKS`` frame (an ``UP_CONSUMER_ACK``
per id, in one write, to a server without ``ACKS``), at once at ``MAX_IDS``, before a later
requeue, never to a newer connection than the one the message came on; a duplicate push
of an acked message acked with the others. No sockets; each test runs its coroutine with
``asyncio.run``."""

from __future__ import annotations

import asyncio

import pytest

from dmq_client import MqConfig
from dmq_client.acks import MAX_IDS
from dmq_client.aio.subscribe import AioMessage, Subscription
from dmq_client.dedup import DedupWindow
from dmq_client.wire import SERVER_FEATURES, Command, Frame, FrameDecoder, unpack_ids

pytestmark = pytest.mark.unit


class FakeLink:
    """What a subscription and its messages use of a ``ServerLink``."""

    def __init__(self, features: str = SERVER_FEATURES):
        self.name = "a:1"
        self.generation = 1
        self.features = frozenset(features.split())
        self.connected = True
        self.writes: list[list[Frame]] = []  # the frames of each write

    def write(self, data: bytes) -> bool:
        self.writes.append(FrameDecoder().feed(data))
        return True

    async def drain(self) -> None:
        pass


class Owner:
    config = MqConfig(servers="a:1")

    def _unsubscribe(self, sub: Subscription) -> None:
        pass


def subscription() -> Subscription:
    return Subscription(Owner(), "orders", "billing", 1000, DedupWindow(1000, 60.0))


def push(sub: Subscription, link: FakeLink, message_id: int) -> None:
    sub.pushed(link, Frame(Command.CONSUMER_PUSH, topic="orders", channel="billing", message_id=message_id,
                           session_id=message_id, producer="p", body=b"x", attempts=1))  # type: ignore[arg-type]


def taken(sub: Subscription) -> list[AioMessage]:
    messages = []
    while not sub.queue.empty():
        item = sub.queue.get_nowait()
        assert isinstance(item, AioMessage)
        messages.append(item)
    return messages


def acked_ids(frames: list[Frame]) -> list[int]:
    ids = []
    for frame in frames:
        ids += unpack_ids(frame.body) if frame.command == Command.UP_CONSUMER_ACKS else [frame.message_id]
    return ids


def test_acks_of_one_turn_go_as_one_frame_and_to_an_older_server_in_one_write():
    """Ten acks made in one turn: nothing written until the turn ends, then one write of one
    UP_CONSUMER_ACKS frame with the ten ids in order; without ACKS listed, one write of
    ten UP_CONSUMER_ACK frames."""

    async def run(link: FakeLink) -> Subscription:
        sub = subscription()
        for message_id in range(1, 11):
            push(sub, link, message_id)
        for message in taken(sub):
            await message.ack()
        assert link.writes == []
        await asyncio.sleep(0)
        return sub

    link = FakeLink()
    sub = asyncio.run(run(link))
    assert [[f.command for f in write] for write in link.writes] == [[Command.UP_CONSUMER_ACKS]]
    assert acked_ids(link.writes[0]) == list(range(1, 11)) and sub.ack_frames_written == 1
    older = FakeLink("CONFIRM PROPS REQUEUE")
    asyncio.run(run(older))
    assert [[f.command for f in write] for write in older.writes] == [[Command.UP_CONSUMER_ACK] * 10]
    assert acked_ids(older.writes[0]) == list(range(1, 11))


def test_a_full_batch_goes_at_once_and_a_reconnect_voids_what_was_held():
    """``MAX_IDS`` acks are written as they fill a frame, the rest at the end of the turn;
    acks held when the connection is replaced (a newer generation) are not written to the
    new one, nor is a later ack of a message from the old one."""

    async def run() -> tuple[FakeLink, FakeLink]:
        full, sub = FakeLink(), subscription()
        for message_id in range(1, MAX_IDS + 3):
            push(sub, full, message_id)
        for message in taken(sub):
            await message.ack()
        assert [acked_ids(write) for write in full.writes] == [list(range(1, MAX_IDS + 1))]
        await asyncio.sleep(0)
        assert acked_ids(full.writes[1]) == [MAX_IDS + 1, MAX_IDS + 2]

        renewed, sub = FakeLink(), subscription()
        for message_id in (1, 2):
            push(sub, renewed, message_id)
        first, second = taken(sub)
        await first.ack()
        renewed.generation += 1  # the connection was lost and made again in this turn
        sub.link_lost(renewed)  # type: ignore[arg-type]
        await second.ack()
        await asyncio.sleep(0)
        return full, renewed

    full, renewed = asyncio.run(run())
    assert len(full.writes) == 2
    assert renewed.writes == []


def test_acks_made_before_a_requeue_are_written_before_it_and_a_duplicate_is_acked():
    """Two acks, then a requeue in the same turn: one write of the acks, then the requeue's
    frame. A second push of an acked message (a redelivery after a lost ack) is acked
    with the others of its turn, not handed out."""

    async def run() -> FakeLink:
        link, sub = FakeLink(), subscription()
        for message_id in (1, 2, 3):
            push(sub, link, message_id)
        one, two, three = taken(sub)
        await one.ack()
        await two.ack()
        requeue = asyncio.ensure_future(three.requeue(delay=0))
        await asyncio.sleep(0)
        sub.requeue_answered(link, Frame(Command.REQUEUE_ACK, topic="orders", channel="billing",  # type: ignore[arg-type]
                                         message_id=3))
        await requeue
        push(sub, link, 1)  # the server did not have the ack of 1: pushed again
        assert sub.queue.empty()
        await asyncio.sleep(0)
        return link

    link = asyncio.run(run())
    assert [[f.command for f in write] for write in link.writes] == [
        [Command.UP_CONSUMER_ACKS], [Command.UP_CONSUMER_REQUEUE], [Command.UP_CONSUMER_ACKS]]
    assert acked_ids(link.writes[0]) == [1, 2] and link.writes[1][0].message_id == 3
    assert acked_ids(link.writes[2]) == [1]

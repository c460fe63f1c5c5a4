"""The asyncio client's confirmation when consumed and batched acks, against a real
dmq-server on a real PostgreSQL (issue 47).

Waits are on the client's own futures, or ``until`` (a condition polled with a deadline),
never a sleep standing in for an event.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from dmq_client import ConsumeStatus, Message, MessageType, Status
from dmq_client.aio import Client

from .support import db_rows
from .test_client import fast_config
from .test_client_aio import WAIT, until
from .test_confirm_consumed import acked_in_postgres

pytestmark = pytest.mark.integration


def no_pending(dsn: str) -> None:
    """Every ack was made durable: nothing of the channel is pending in PostgreSQL."""
    deadline = time.monotonic() + WAIT
    while db_rows(dsn, "SELECT count(*) FROM dmq_pending") != [(0,)]:
        assert time.monotonic() < deadline, "acks were not made durable"
        time.sleep(0.05)


def test_consumed_after_the_ack_and_a_deadline_naming_the_waiting_channel(make_server, topic, pg_dsn):
    """A confirmed send returns its SendResult and a future: it stays open while the copy
    is unacked and resolves CONSUMED (naming the channel) once the aio consumer acked; a
    second send whose copy is left unacked resolves DEADLINE with the channel waiting. A
    delayed message is refused (NOT_SENT with its INVALID_MESSAGE result), a wrong
    ``confirm`` raises, and a plain send still returns a bare SendResult."""
    server = make_server()

    async def run():
        async with Client(fast_config(server)) as client:
            with pytest.raises(ValueError, match="confirm must be"):
                await client.send(Message(topic, b"x"), confirm="stored")  # type: ignore[call-overload]
            delayed, not_sent = await client.send(
                Message(topic, b"later", msg_type=MessageType.DELAY, due_ms=int(time.time() * 1000) + 60000),
                confirm="consumed")
            assert delayed.status is Status.INVALID_MESSAGE and "delayed" in delayed.description
            assert (await not_sent).status is ConsumeStatus.NOT_SENT

            sent, consumed = await client.send(Message(topic, b"order 1"), confirm="consumed", confirm_timeout=60)
            assert sent.status is Status.SUCCESS and not consumed.done()
            subscription = client.subscribe(topic, "billing", credit=10)
            message = await anext(subscription)
            assert message.message_id == sent.message_id and not consumed.done()

            probe, late = await client.send(Message(topic, b"probe"), confirm="consumed", confirm_timeout=0.3)
            deadline = await late  # its copy is pushed to this consumer and never acked
            assert deadline.status is ConsumeStatus.DEADLINE and deadline.waiting == ("billing",)
            assert deadline.message_id == probe.message_id and deadline.acked == ()
            assert not consumed.done(), "resolved before the ack"

            await message.ack()
            outcome = await consumed
            assert outcome.status is ConsumeStatus.CONSUMED and outcome.ok
            assert (outcome.acked, outcome.dead, outcome.waiting) == (("billing",), (), ())
            assert (outcome.message_id, outcome.session_id, outcome.topic) == (sent.message_id, sent.session_id, topic)
            assert acked_in_postgres(pg_dsn, topic, "billing", sent.message_id)

            plain = await client.send(Message(topic, b"plain"))
            assert plain.status is Status.SUCCESS and plain.message_id
            return client.sends

    sends = asyncio.run(run())
    assert len(sends.confirms) == 0, "the table kept an entry"


def test_a_lost_connection_reports_the_confirmation_lost(make_server, topic):
    """The server watching the message is killed: the confirmation resolves LOST as the
    connection drops (the message stays stored), and the table is empty."""
    server = make_server()

    async def run():
        async with Client(fast_config(server)) as client:
            sent, consumed = await client.send(Message(topic, b"x"), confirm="consumed", confirm_timeout=60)
            assert sent.status is Status.SUCCESS
            server.kill()
            lost = await consumed
            assert lost.status is ConsumeStatus.LOST and "was lost" in lost.description
            assert lost.message_id == sent.message_id and lost.session_id == sent.session_id
            assert len(client.sends.confirms) == 0

    asyncio.run(run())


def test_acks_made_together_go_as_one_frame_and_before_a_later_requeue(make_server, topic, pg_dsn):
    """Twenty messages handed out together and acked in one turn of the loop: held until
    the turn ends, then written as one UP_CONSUMER_ACKS frame; the acks made before a
    requeue are written before it; every ack is applied (nothing pending in PostgreSQL)."""
    server = make_server()
    count = 20

    async def run():
        async with Client(fast_config(server)) as client:
            results = await asyncio.gather(*(client.send(Message(topic, f"m{i}")) for i in range(count)))
            assert {r.status for r in results} == {Status.SUCCESS}
            subscription = client.subscribe(topic, "billing", credit=count)
            await until(lambda: subscription.queue.qsize() == count)
            messages = [await anext(subscription) for _ in range(count)]
            for message in messages[:-1]:
                await message.ack()
            assert subscription.ack_frames_written == 0, "an ack was written before the turn ended"
            await messages[-1].requeue(delay=0)
            assert subscription.ack_frames_written == 1, "the held acks did not go, in one frame, before the requeue"
            again = await anext(subscription)
            assert (again.message_id, again.attempts) == (messages[-1].message_id, 2)
            await again.ack()
            await until(lambda: subscription.ack_frames_written == 2)

    asyncio.run(run())
    no_pending(pg_dsn)

"""Only the consumer holding a copy may acknowledge it (dmq protocol, like NSQ's FIN).

Before: any connection could send UP_CONSUMER_ACK for any message id, subscribed or
not; the copy left flight, and when its real holder died it was never redelivered.
"""

from __future__ import annotations

import json

from dmq_client.wire import Command, Frame, pack_ids

from .support import db_rows, http_get, wait_for


def _acks_refused(server) -> int:
    status, body = http_get(server.http + "/stats")
    assert status == 200
    return json.loads(body)["acks"]["refused"]


def _ack_frame(topic: str, channel: str, message_id: int) -> Frame:
    return Frame(Command.UP_CONSUMER_ACK, topic=topic, channel=channel, message_id=message_id)


def test_acks_from_others_are_refused_and_the_copy_comes_back_when_its_holder_dies(make_server, topic):
    server = make_server()
    with server.client() as producer:
        reply = producer.send(topic, b"precious")
    assert reply.command == Command.SEND_SUCCESS_ACK
    mid = reply.message_id

    holder = server.client()
    holder.subscribe(topic, "billing", credit=1)
    push = holder.receive(timeout=10)
    assert push is not None and push.message_id == mid and push.attempts == 1

    with server.client() as stranger, server.client() as rival:
        stranger.write(_ack_frame(topic, "billing", mid))  # no subscription at all
        rival.subscribe(topic, "billing", credit=1)
        rival.write(_ack_frame(topic, "billing", mid))  # subscribed, but not the holder

        wait_for(lambda: _acks_refused(server) == 2)

        holder.close()  # dies without acknowledging
        again = rival.receive(timeout=10)
        assert again is not None and again.message_id == mid, "the copy was lost to a stranger's ack"
        assert again.attempts == 2
        rival.ack(again)


def test_an_acks_frame_is_durable_for_the_ids_held_and_refused_for_the_rest(make_server, topic, pg_dsn):
    """UP_CONSUMER_ACKS on a real server and PostgreSQL: a stranger's frame acknowledges
    nothing; the holder's, with an id it does not hold inside, makes every held copy's
    ack durable (nothing left pending) and counts the one refused."""
    server = make_server()
    with server.client() as producer:
        sent = [producer.send(topic, b"m%d" % i) for i in range(120)]
    assert {r.command for r in sent} == {Command.SEND_SUCCESS_ACK}
    with server.client() as holder, server.client() as stranger:
        holder.subscribe(topic, "billing", credit=500)
        pushes = [holder.receive(timeout=10) for _ in sent]
        assert None not in pushes and {p.message_id for p in pushes} == {r.message_id for r in sent}
        stranger.ack_many(pushes)
        wait_for(lambda: _acks_refused(server) == len(pushes))
        assert len(_pending(pg_dsn, topic)) == len(pushes)
        ids = [p.message_id for p in pushes]
        holder.write(Frame(Command.UP_CONSUMER_ACKS, topic=topic, channel="billing",
                           body=pack_ids(ids[:60] + [max(ids) + 10**6] + ids[60:])))
        wait_for(lambda: not _pending(pg_dsn, topic), timeout=15)
        assert _acks_refused(server) == len(pushes) + 1


def _pending(pg_dsn: str, topic: str) -> list:
    return db_rows(pg_dsn, "SELECT 1 FROM dmq_pending WHERE topic = %s", topic)

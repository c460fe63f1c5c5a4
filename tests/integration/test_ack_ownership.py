"""Only the consumer holding a copy may acknowledge it (dmq protocol, like NSQ's FIN).

Before: any connection could send UP_CONSUMER_ACK for any message id, subscribed or
not; the copy left flight, and when its real holder died it was never redelivered.
"""

from __future__ import annotations

import json

from dmq_client.wire import Command, Frame

from .support import http_get, wait_for


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

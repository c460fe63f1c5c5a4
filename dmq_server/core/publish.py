"""A publish as every edge hands it to the broker, and its answer.

The dmq protocol's SEND/RESEND, NSQ's PUB/MPUB/DPUB and HTTP ``/pub`` ``/mpub`` each
build one ``PublishRequest`` from their own wire fields and call
``Broker.publish(request, done)``; the broker routes it to the reliable or the fast
store by the topic's settings and calls ``done`` exactly once, with ``Published`` or a
``core.errors.DmqError``, when every body of the request has an outcome. So the
countdown over a batch, the choice of store and the checks of a send exist once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dmq_client.spelling import MAX_TIME_MS
from dmq_client.wire import valid_name

from dmq_server.core.errors import DmqError, Invalid

__all__ = ["PublishRequest", "Published", "check_request", "check_send", "check_sender"]


@dataclass(slots=True)
class PublishRequest:
    topic: str
    producer: str
    bodies: list[bytes]  # one body, or a batch (MPUB, /mpub): answered together
    # The producer's own id of a single body (dmq: its duplicate-suppression key);
    # None: the broker numbers each body (NSQ publishers have no ids of their own).
    session_id: int | None = None
    produced_ms: int = 0  # the producer's clock (Unix ms), 0 for none
    due_ms: int | None = None  # deliver not before this (Unix ms): a delayed message
    # False for a plain dmq SEND: refused if its (producer, session id) is already
    # stored, since answering with the stored row would ack a message never stored.
    resend: bool = True
    # What an unregistered name means: a fast topic made on first use (NSQ's rule),
    # or an unknown topic to refuse with E_NO_TOPIC (the dmq protocol's rule).
    create_fast: bool = False


@dataclass(slots=True)
class Published:
    """Every body was stored. A batch's ``message_id`` is its first message's; a fast
    topic's ids are the fast store's 64-bit GUIDs. ``duplicate``: a resend answered
    from the row already stored."""

    message_id: int
    duplicate: bool = False
    count: int = 1


def stored_before(producer: str, session_id: int, message_id: int) -> Invalid:
    """The answer to a plain send (not a resend) whose (producer, session id) is already
    stored: answering it with the stored message would acknowledge a message that was
    never stored, so it is refused."""
    return Invalid(
        f"session id {session_id} of producer {producer!r} is already stored "
        f"(message {message_id}): a new message needs a new session id, a retry "
        "of this one must be sent as UP_PRODUCER_RESEND",
    )


def check_request(
    request: PublishRequest, *, registered: bool, max_msg_size: int, max_delay_s: float, now_s: float
) -> DmqError | None:
    """The rules every send obeys, whichever store takes it, checked before it joins a
    group-commit batch: a value PostgreSQL would refuse must fail its own send, not the
    batch. ``registered``: the topic is in the registry (its name was checked then)."""
    error = check_sender(request.topic, request.producer, registered=registered) or check_send(
        request.session_id, request.bodies, request.produced_ms, max_msg_size)
    if error is not None:
        return error
    due_ms = request.due_ms
    if due_ms is not None:
        if due_ms <= 0:
            return Invalid("a DELAY message needs due_ms (Unix ms) above 0")
        limit_ms = int((now_s + max_delay_s) * 1000)
        if due_ms > limit_ms:
            return Invalid(f"due_ms {due_ms} is more than --max-delay ({max_delay_s:g}s) ahead")
    return None


def check_sender(topic: str, producer: str, *, registered: bool) -> DmqError | None:
    """``check_request``'s rules of the topic and the producer: what every send of a run
    from one producer to one topic shares (``Broker.publish_sends``)."""
    if not registered and not valid_name(topic):
        return Invalid(f"topic name {topic!r} is not valid", code="E_BAD_TOPIC")
    if not producer or len(producer) > 64:
        return Invalid("producer id must be 1..64 characters")
    if not producer.isprintable():
        # PostgreSQL text cannot hold NUL; control characters are never meant
        return Invalid(f"producer id {producer!r} holds a control character")
    return None


def check_send(
    session_id: int | None, bodies: Sequence[bytes], produced_ms: int, max_msg_size: int
) -> DmqError | None:
    """``check_request``'s rules of a send's own fields (a delay's aside)."""
    if session_id is not None and session_id < 0:
        return Invalid(f"session id {session_id} is negative")
    for body in bodies:
        if len(body) > max_msg_size:
            return Invalid(f"message too big {len(body)} > {max_msg_size}", code="E_BAD_BODY")
    if not 0 <= produced_ms <= MAX_TIME_MS:
        return Invalid(
            f"timestamp_ms {produced_ms} is not Unix milliseconds "
            f"(0 for none, or up to {MAX_TIME_MS} = 9999-12-31)"
        )
    return None

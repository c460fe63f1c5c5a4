"""A publish as every edge hands it to the broker, and its answer.

The dmq protocol's SEND/RESEND, NSQ's PUB/MPUB/DPUB and HTTP ``/pub`` ``/mpub`` each
build one ``PublishRequest`` from their own wire fields and call
``Broker.publish(request, done)``; the broker routes it to the reliable or the fast
store by the topic's settings and calls ``done`` exactly once, with ``Published`` or a
``core.errors.DmqError``, when every body of the request has an outcome. So the
countdown over a batch, the choice of store and the checks of a send exist once.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PublishRequest", "Published"]


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

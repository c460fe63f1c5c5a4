"""A publish as every edge hands it to the broker, and its answer.

Every way a message enters (the dmq protocol's SEND and RESEND, alone or a read's run
of them, delayed or not; NSQ's PUB, a read's run of PUBs, MPUB, DPUB; HTTP ``/pub`` and
``/mpub``) builds one ``PublishRequest`` with keyword fields and hands it to the
broker: ``Broker.publish(request, done)`` answers the request once (an MPUB's batch),
``Broker.publish_each(request, answer)`` answers each message as if sent alone (a
read's run of sends or PUBs). The broker routes it to the reliable or the fast store by
the topic's settings, and the stores take its messages as they are: a ``Send`` is the
value the reliable store's group commit writes (its fields are the columns), and a
request's ``bodies`` are what the fast store puts on its queues. So the countdown over
a batch, the choice of store and the checks of a send exist once.

A request carries its messages in one of two forms, whichever its edge has at no cost:
``bodies``, which the broker numbers (NSQ and HTTP publishers have no ids of their own;
one time for all), or ``sends``, each with its producer's own session id, time and
resend flag (the dmq protocol). A send's properties (key, priority, headers:
``dmq_client.wire.properties``) are two more keyword fields of ``Send``: the decoded value,
whose fields are three more columns, and the wire text it came as, which the message's
pushes repeat without encoding it again. A send without properties has the defaults,
and the group commit stores it exactly as before they existed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dmq_client.spelling import MAX_TIME_MS
from dmq_client.wire import valid_name
from dmq_client.wire.properties import NO_PROPERTIES, Properties

from dmq_server.core.errors import DmqError, Invalid

__all__ = [
    "PublishRequest", "Published", "Send", "check_request", "check_send", "check_sender", "check_sends", "new_request",
    "new_send",
]


@dataclass(slots=True, kw_only=True)
class Send:
    """One message as the reliable store takes it: the group commit writes these
    fields as they are (``topic`` and ``producer`` are the request's, shared, not
    copied). ``session_id`` is the producer's duplicate-suppression key (dmq), or the
    broker's number for a body that came without one (NSQ, HTTP)."""

    topic: str
    producer: str
    session_id: int
    body: bytes
    produced_ms: int = 0  # the producer's clock (Unix ms), 0 for none
    # False for a plain dmq SEND: refused if its (producer, session id) is already
    # stored, since answering with the stored row would ack a message never stored.
    resend: bool = True
    # key, priority and headers (checked where the send came in: a value here never fails
    # a batch), and their wire text ("" for none), which every push of the message repeats
    properties: Properties = NO_PROPERTIES
    status: str = ""


_new = object.__new__


def new_send(*, topic: str, producer: str, session_id: int, body: bytes, produced_ms: int = 0,
             resend: bool = True, properties: Properties = NO_PROPERTIES, status: str = "") -> Send:
    """``Send(...)`` for the paths run once a message: the same value from the same
    keywords, without the dict CPython 3.11 builds to pass keywords to a class (a
    quarter of a microsecond a send; bench/message_cost.py). A field added to ``Send``
    is added here too (``tests/unit/test_publish_value.py`` checks every one is set)."""
    send = _new(Send)
    send.topic = topic
    send.producer = producer
    send.session_id = session_id
    send.body = body
    send.produced_ms = produced_ms
    send.resend = resend
    send.properties = properties
    send.status = status
    return send


@dataclass(slots=True, kw_only=True)
class PublishRequest:
    """What a producer asked to publish to one topic: ``bodies`` (numbered by the
    broker) or ``sends`` (numbered by their producer), not both."""

    topic: str
    producer: str
    bodies: list[bytes] | None = None  # numbered by the broker (NSQ, HTTP), one time for all
    sends: list[Send] | None = None  # each with its producer's session id, time, resend (dmq)
    produced_ms: int = 0  # the time of ``bodies`` (Unix ms), 0 for none
    due_ms: int | None = None  # deliver not before this (Unix ms): a delayed message
    # What an unregistered name means: a fast topic made on first use (NSQ's rule),
    # or an unknown topic to refuse with E_NO_TOPIC (the dmq protocol's rule).
    create_fast: bool = False

    def __len__(self) -> int:
        """How many messages: each is answered (``publish_each``) or counted once."""
        bodies = self.bodies
        return len(bodies) if bodies is not None else len(self.sends or ())

    def payloads(self) -> list[bytes]:
        """Every message's body, in order (what the fast store puts on its queues)."""
        bodies = self.bodies
        return bodies if bodies is not None else [send.body for send in self.sends or ()]

    def numbered(self, new_id: Callable[[], int]) -> list[Send]:
        """Every message as a ``Send``; ``new_id`` numbers ``bodies``."""
        sends = self.sends
        if sends is not None:
            return sends
        topic, producer, produced_ms = self.topic, self.producer, self.produced_ms
        return [new_send(topic=topic, producer=producer, session_id=new_id(), body=body, produced_ms=produced_ms)
                for body in self.bodies or ()]

    def alone(self, index: int) -> PublishRequest:
        """Message ``index`` as a request of its own (answered as if sent alone)."""
        sends = self.sends
        if sends is not None:
            return PublishRequest(topic=self.topic, producer=self.producer, sends=[sends[index]], due_ms=self.due_ms,
                                  create_fast=self.create_fast)
        return PublishRequest(topic=self.topic, producer=self.producer, bodies=[(self.bodies or [])[index]],
                              produced_ms=self.produced_ms, due_ms=self.due_ms, create_fast=self.create_fast)


@dataclass(slots=True)
class Published:
    """Every body was stored. A batch's ``message_id`` is its first message's; a fast
    topic's ids are the fast store's 64-bit GUIDs. ``duplicate``: a resend answered
    from the row already stored."""

    message_id: int
    duplicate: bool = False
    count: int = 1


def new_request(*, topic: str, producer: str, bodies: list[bytes] | None = None, sends: list[Send] | None = None,
                produced_ms: int = 0, due_ms: int | None = None, create_fast: bool = False) -> PublishRequest:
    """``PublishRequest(...)`` for the paths run once a read (a paced producer's read
    holds one send), as ``new_send``: the same value, without a dict per call."""
    request = _new(PublishRequest)
    request.topic = topic
    request.producer = producer
    request.bodies = bodies
    request.sends = sends
    request.produced_ms = produced_ms
    request.due_ms = due_ms
    request.create_fast = create_fast
    return request


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
    error = check_sender(request.topic, request.producer, registered=registered)
    if error is not None:
        return error
    sends = request.sends
    if sends is None:
        error = check_send(None, request.bodies or (), request.produced_ms, max_msg_size)
    else:
        for send in sends:
            error = check_send(send.session_id, (send.body,), send.produced_ms, max_msg_size)
            if error is not None:
                break
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
    from one producer to one topic shares (``Broker.publish_each``)."""
    if not registered and not valid_name(topic):
        return Invalid(f"topic name {topic!r} is not valid", code="E_BAD_TOPIC")
    if not producer or len(producer) > 64:
        return Invalid("producer id must be 1..64 characters")
    if not producer.isprintable():
        # PostgreSQL text cannot hold NUL; control characters are never meant
        return Invalid(f"producer id {producer!r} holds a control character")
    return None


def check_sends(sends: Sequence[Send], max_msg_size: int) -> list[tuple[int, DmqError]]:
    """``check_send`` of each send of a run, in one call (``Broker.publish_each``): the
    refused ones, each with its position. A send is tested against ``check_send``'s
    rules here inline and only a refused one calls it for its error: the run's sends
    pass without a call each (tests/unit/test_publish_value.py holds the two together)."""
    refused: list[tuple[int, DmqError]] = []
    for i, send in enumerate(sends):
        session_id, body, produced_ms = send.session_id, send.body, send.produced_ms
        if session_id < 0 or len(body) > max_msg_size or not 0 <= produced_ms <= MAX_TIME_MS:
            error = check_send(session_id, (body,), produced_ms, max_msg_size)
            refused.append((i, error or Invalid(f"send {i} refused")))
    return refused


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

"""What every client checks and writes for one send, shared by ``MqClient`` and the
asyncio client (``dmq_client.aio``): the client-side checks of a message and the bytes
of its ``UP_PRODUCER_SEND`` or ``UP_PRODUCER_RESEND`` frame.

Kept apart from both clients so that a rule added here (a new field, a new check) holds
for both: the server deduplicates resends by ``(producer, session_id)`` whichever client
wrote them, and a message one client refuses the other must refuse the same way.
"""

from __future__ import annotations

from .message import Message, Status
from .session import SESSION_ID_MAX
from .wire import FEATURE_CONFIRM, FEATURE_PROPS, Command, Frame, MessageType, PropertiesError, encode, valid_name

__all__ = ["REPLY_STATUS", "check_confirm", "check_message", "check_server", "send_frame"]

#: The status of a send each server answer gives it.
REPLY_STATUS = {
    Command.SEND_SUCCESS_ACK: Status.SUCCESS,
    Command.SEND_NO_TOPIC_ACK: Status.NO_TOPIC,
    Command.SEND_SERVER_ERROR: Status.SERVER_ERROR,
    Command.SEND_EXCEED_LIMIT_ACK: Status.RATE_LIMIT_EXCEEDED,
    Command.SEND_INVALID_ACK: Status.INVALID_MESSAGE,
}


def check_message(message: Message, max_body_size: int) -> str:
    """Why the message cannot be sent (a status text ``E_… description``), or ''."""
    if not isinstance(message.topic, str) or not valid_name(message.topic):
        return f"E_BAD_TOPIC topic name {message.topic!r} is not valid"
    if not isinstance(message.body, bytes):
        return f"E_BAD_BODY body must be bytes or str, not {type(message.body).__name__}"
    if len(message.body) > max_body_size:
        return f"E_BAD_BODY body of {len(message.body)} bytes exceeds max_body_size {max_body_size}"
    sid = message.session_id
    if sid is not None and (not isinstance(sid, int) or isinstance(sid, bool) or not 0 <= sid <= SESSION_ID_MAX):
        return f"E_INVALID session id {sid!r} is not an integer in 0..{SESSION_ID_MAX}"
    if message.msg_type == MessageType.DELAY:
        if not isinstance(message.due_ms, int) or message.due_ms <= 0:
            return f"E_INVALID a DELAY message needs a due time, not {message.due_ms!r}"
    elif message.msg_type != MessageType.RELIABLE:
        return f"E_INVALID unknown message type {message.msg_type!r}"
    try:
        message.status()
    except PropertiesError as exc:
        return exc.status()
    return ""


def check_confirm(message: Message, confirm_ms: int) -> str:
    """Why the message's consumption cannot be confirmed (``confirm_ms`` > 0), or ''."""
    if confirm_ms and message.msg_type == MessageType.DELAY:
        return "E_INVALID a delayed message's consumption cannot be confirmed"
    return ""


def check_server(message: Message, confirm_ms: int, server: str, server_features: frozenset[str]) -> str:
    """Why the message must not be written to ``server`` (whose greeting listed
    ``server_features``), or '': an older server would store it without what the caller
    counts on (a confirmation, the key, priority or headers)."""
    if confirm_ms and FEATURE_CONFIRM not in server_features:
        return (f"E_UNSUPPORTED server {server} cannot confirm consumption (its SERVER_HEALTH does "
                f"not list {FEATURE_CONFIRM}): upgrade it, or send without confirm; not sent")
    if FEATURE_PROPS not in server_features and message.properties:
        return (f"E_UNSUPPORTED server {server} does not keep a message's key, priority or headers "
                f"(its SERVER_HEALTH does not list {FEATURE_PROPS}): upgrade it, or send without them; "
                "not sent")
    return ""


def send_frame(message: Message, command: Command, session_id: int, producer: str, timestamp_ms: int,
               confirm_ms: int = 0) -> bytes:
    """The frame of a send (``UP_PRODUCER_SEND``) or resend (``UP_PRODUCER_RESEND``) of a
    message ``check_message`` passed."""
    return encode(
        Frame(
            command,
            session_id=session_id,
            topic=message.topic,
            producer=producer,
            msg_type=message.msg_type,
            due_ms=message.due_ms,
            timestamp_ms=timestamp_ms,
            credit=confirm_ms,  # 0: no confirmation asked (docs/protocol.md §4.14)
            status=message.status(),  # the properties, '' for none
            body=message.body,
        )
    )

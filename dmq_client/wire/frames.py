"""The frames of the dmq wire protocol: what travels, not how.

One frame type (``Frame``) carries every command, like DMQ's ``MqBody``: a command
code plus the fields that command uses. Keeping a single shape makes the codec
small, lets the client and server share it, and makes every frame round-trip
through the same code path (which is what the property tests check).
``docs/protocol.md`` is the normative description of each command.
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass, field

__all__ = [
    "MAGIC",
    "CONFIRM_MAX_MS",
    "REQUEUE_MAX_MS",
    "Command",
    "MessageType",
    "Frame",
    "UPSTREAM",
    "DOWNSTREAM",
    "SEND_REPLIES",
    "SUBSCRIBE_REPLIES",
    "valid_name",
    "NAME_MAX_LENGTH",
    "PRODUCER_MAX_LENGTH",
    "STATUS_MAX_LENGTH",
]

#: Sent once by the client as the first four bytes of a connection. The server
#: sniffs these bytes to choose the protocol (NSQ clients send ``b"  V2"``).
MAGIC = b"DMQ1"

NAME_MAX_LENGTH = 64
PRODUCER_MAX_LENGTH = 64
STATUS_MAX_LENGTH = 4096
#: The longest a producer may ask the server to watch for its message's consumption
#: (a send's ``credit``, ms): a day, so a forgotten confirmation holds memory that long at most.
CONFIRM_MAX_MS = 86_400_000
#: The longest delay an UP_CONSUMER_REQUEUE can carry in its u32 ``credit`` field (ms, about
#: 49 days). The server's own bound, ``--max-req-timeout`` (an hour by default, the one NSQ's
#: REQ has), is lower; a client checks against this one and the server answers the rest.
REQUEUE_MAX_MS = 0xFFFFFFFF

_NAME_RE = re.compile(r"^[.a-zA-Z0-9_-]+(#ephemeral)?$")


@functools.lru_cache(maxsize=1024)
def valid_name(name: str) -> bool:
    """Topic and channel names follow NSQ's rule so both protocols share them.

    Remembered for the last 1,024 names: a publish checks its topic's name (an NSQ
    ``PUB`` twice, before reading the body and when routed), and the regex is a
    tenth of a fast-path publish's CPU; a peer sending ever new names only evicts."""
    # fullmatch, not match: Python's ``$`` also matches before a trailing newline,
    # which would accept "orders\n" (Go's ``$``, which NSQ uses, does not).
    return 1 <= len(name) <= NAME_MAX_LENGTH and _NAME_RE.fullmatch(name) is not None


class Command(enum.IntEnum):
    """Command codes. Upstream (client to server) codes are below 32."""

    # client -> server
    UP_SUBSCRIBE = 1
    UP_PRODUCER_SEND = 2
    UP_CONSUMER_ACK = 3
    UP_PRODUCER_RESEND = 4
    UP_CREDIT = 5
    UP_HEARTBEAT = 6
    UP_AUTH = 7
    UP_CONSUMER_ACKS = 8
    UP_CONSUMER_REQUEUE = 9
    # server -> client
    SUBSCRIBE_ACK = 32
    SEND_SUCCESS_ACK = 33
    SEND_NO_TOPIC_ACK = 34
    SUBSCRIBE_NO_TOPIC_ACK = 35
    SUBSCRIBE_NO_CLIENT_ID_ACK = 36
    SEND_SERVER_ERROR = 37
    SUBSCRIBE_SERVER_ERROR = 38
    SEND_EXCEED_LIMIT_ACK = 39
    CONSUMER_PUSH = 40
    SERVER_REBOOT = 41
    SERVER_HEALTH = 42
    SERVER_HEARTBEAT = 43
    SEND_INVALID_ACK = 44
    SUBSCRIBE_INVALID_ACK = 45
    PROTOCOL_ERROR = 46
    AUTH_ACK = 47
    SEND_CONSUMED_ACK = 48
    REQUEUE_ACK = 49


#: What a server accepts beyond the first set of version 1, as it lists them, space
#: separated, in ``SUBSCRIBE_ACK``'s status (docs/protocol.md §4.1) and in the body of
#: ``SERVER_HEALTH`` (§4.9: a producer never subscribes, and old clients ignore that
#: body). A client uses one only over a connection whose server listed it, so a new
#: client keeps working against an older server during a rolling upgrade.
FEATURE_ACKS = "ACKS"  # UP_CONSUMER_ACKS (§4.13)
FEATURE_CONFIRM = "CONFIRM"  # a send's credit asks for SEND_CONSUMED_ACK (§4.14)
FEATURE_PROPS = "PROPS"  # a send's status carries its key, priority and headers (wire.properties)
FEATURE_REQUEUE = "REQUEUE"  # UP_CONSUMER_REQUEUE and its REQUEUE_ACK (§4.16)
SERVER_FEATURES = f"{FEATURE_ACKS} {FEATURE_CONFIRM} {FEATURE_PROPS} {FEATURE_REQUEUE}"


def features(status: str) -> frozenset[str]:
    """The commands a ``SUBSCRIBE_ACK``'s status lists (unknown words included: a
    client ignores what it does not know)."""
    return frozenset(status.split())


UPSTREAM = frozenset(c for c in Command if c < 32)
DOWNSTREAM = frozenset(c for c in Command if c >= 32)

#: Replies a producer can get to a send or resend; each carries its session id.
SEND_REPLIES = frozenset(
    {
        Command.SEND_SUCCESS_ACK,
        Command.SEND_NO_TOPIC_ACK,
        Command.SEND_SERVER_ERROR,
        Command.SEND_EXCEED_LIMIT_ACK,
        Command.SEND_INVALID_ACK,
    }
)

#: Replies a consumer can get to a subscribe.
SUBSCRIBE_REPLIES = frozenset(
    {
        Command.SUBSCRIBE_ACK,
        Command.SUBSCRIBE_NO_TOPIC_ACK,
        Command.SUBSCRIBE_NO_CLIENT_ID_ACK,
        Command.SUBSCRIBE_SERVER_ERROR,
        Command.SUBSCRIBE_INVALID_ACK,
    }
)


class MessageType(enum.IntEnum):
    """RELIABLE is stored and pushed at once; DELAY waits for ``due_ms``."""

    RELIABLE = 0
    DELAY = 1


@dataclass(slots=True)
class Frame:
    """One protocol frame. Fields a command does not use keep their defaults.

    Times are integer milliseconds since the Unix epoch. ``credit`` is the
    consumer's window of unacknowledged pushes (UP_SUBSCRIBE, UP_CREDIT) or the
    heartbeat interval in milliseconds (UP_HEARTBEAT, SERVER_HEARTBEAT).

    Treat frames as values. The class is not frozen only because a frozen
    dataclass's ``__init__`` costs several times more, and one is built for
    every message on the hot path.
    """

    command: Command
    session_id: int = 0
    message_id: int = 0
    topic: str = ""
    channel: str = ""
    producer: str = ""
    msg_type: MessageType = MessageType.RELIABLE
    due_ms: int = 0
    timestamp_ms: int = 0
    attempts: int = 0
    credit: int = 0
    status: str = ""
    body: bytes = field(default=b"", repr=False)

"""The dmq wire protocol, sans-IO: frames, the codec and the name rules.

Imports nothing from Twisted, psycopg or socket, so it serves the server, the
blocking client and the client library alike.
"""

from .codec import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, FrameError, encode, pack_ids, unpack_ids
from .frames import (
    DOWNSTREAM,
    MAGIC,
    SEND_REPLIES,
    SUBSCRIBE_REPLIES,
    UPSTREAM,
    Command,
    Frame,
    MessageType,
    valid_name,
)

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "DOWNSTREAM",
    "MAGIC",
    "SEND_REPLIES",
    "SUBSCRIBE_REPLIES",
    "UPSTREAM",
    "Command",
    "Frame",
    "FrameDecoder",
    "FrameError",
    "MessageType",
    "encode",
    "pack_ids",
    "unpack_ids",
    "valid_name",
]

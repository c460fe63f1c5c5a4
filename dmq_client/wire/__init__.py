"""The dmq wire protocol, sans-IO: frames, the codec and the name rules.

Imports nothing from Twisted, psycopg or socket, so it serves the server, the
blocking client and the client library alike.
"""

from .codec import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, FrameError, encode, pack_ids, unpack_ids
from .frames import (
    DOWNSTREAM,
    FEATURE_ACKS,
    MAGIC,
    SERVER_FEATURES,
    SEND_REPLIES,
    SUBSCRIBE_REPLIES,
    UPSTREAM,
    Command,
    Frame,
    MessageType,
    features,
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
    "FEATURE_ACKS",
    "SERVER_FEATURES",
    "Frame",
    "FrameDecoder",
    "FrameError",
    "MessageType",
    "encode",
    "features",
    "pack_ids",
    "unpack_ids",
    "valid_name",
]

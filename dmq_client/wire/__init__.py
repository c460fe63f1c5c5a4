"""The dmq wire protocol, sans-IO: frames, the codec and the name rules.

Imports nothing from Twisted, psycopg or socket, so it serves the server, the
blocking client and the client library alike.
"""

from .codec import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, FrameError, encode, pack_ids, unpack_ids
from .confirm import ConsumedReport, consumed_status, parse_consumed
from .properties import NO_PROPERTIES, Properties, PropertiesError, decode_properties, encode_properties
from .frames import (
    CONFIRM_MAX_MS,
    DOWNSTREAM,
    FEATURE_ACKS,
    FEATURE_CONFIRM,
    FEATURE_PROPS,
    FEATURE_REQUEUE,
    MAGIC,
    REQUEUE_MAX_MS,
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
    "CONFIRM_MAX_MS",
    "ConsumedReport",
    "FEATURE_CONFIRM",
    "FEATURE_PROPS",
    "FEATURE_REQUEUE",
    "REQUEUE_MAX_MS",
    "NO_PROPERTIES",
    "Properties",
    "PropertiesError",
    "decode_properties",
    "encode_properties",
    "consumed_status",
    "parse_consumed",
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

"""IDENTIFY, sans-IO: parse the JSON body, validate it as nsqd does, build the reply.

nsqd decodes the body into a typed Go struct (``identifyDataV2``), so a field of the
wrong JSON type is a decode error, unknown keys are ignored and ``null`` leaves the
default. Then ``clientV2.Identify`` checks heartbeat interval, output buffer
(timeout, then size), sample rate and message timeout, in that order, each with its
own message (``E_BAD_BODY IDENTIFY <message>``). With ``feature_negotiation`` the
reply is JSON with every field clients read, keys in Go's order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from dmq_server.core.nsq_errors import FatalClientError

__all__ = [
    "VERSION",
    "ClientSettings",
    "parse_identify",
    "negotiate",
    "deflate_choice",
    "identify_reply",
    "MAX_HEARTBEAT_INTERVAL",
    "MAX_OUTPUT_BUFFER_SIZE",
    "MAX_OUTPUT_BUFFER_TIMEOUT",
    "MAX_DEFLATE_LEVEL",
]

#: The nsqd version dmq answers as (IDENTIFY, /info): clients and nsqadmin parse it as semver.
VERSION = "1.3.0"

MAX_HEARTBEAT_INTERVAL = 60.0
MAX_OUTPUT_BUFFER_SIZE = 65536
MIN_OUTPUT_BUFFER_TIMEOUT = 0.025
MAX_OUTPUT_BUFFER_TIMEOUT = 30.0
DEFAULT_OUTPUT_BUFFER_SIZE = 16384
DEFAULT_OUTPUT_BUFFER_TIMEOUT = 0.25
MAX_DEFLATE_LEVEL = 6

_TYPES: dict[str, type] = {
    "client_id": str,
    "hostname": str,
    "user_agent": str,
    "topology_region": str,
    "topology_zone": str,
    "feature_negotiation": bool,
    "tls_v1": bool,
    "snappy": bool,
    "deflate": bool,
    "heartbeat_interval": int,
    "output_buffer_size": int,
    "output_buffer_timeout": int,
    "deflate_level": int,
    "sample_rate": int,
    "msg_timeout": int,
}
_BAD_JSON = ("E_BAD_BODY", "IDENTIFY failed to decode JSON body")


@dataclass(frozen=True)
class ClientSettings:
    """What IDENTIFY may change on a connection (seconds for durations)."""

    heartbeat_interval: float
    msg_timeout: float
    output_buffer_size: int = DEFAULT_OUTPUT_BUFFER_SIZE
    output_buffer_timeout: float = DEFAULT_OUTPUT_BUFFER_TIMEOUT
    sample_rate: int = 0


def parse_identify(body: bytes) -> dict[str, Any]:
    """The known fields present in the JSON body, type-checked like Go's decoder."""
    try:
        data = json.loads(body)
    except ValueError:
        raise FatalClientError(*_BAD_JSON) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise FatalClientError(*_BAD_JSON)
    fields: dict[str, Any] = {}
    for key, kind in _TYPES.items():
        value = data.get(key)
        if value is None:
            continue
        if type(value) is not kind or (type(value) is int and not -(2**63) <= value < 2**63):
            raise FatalClientError(*_BAD_JSON)
        fields[key] = value
    if not -(2**31) <= fields.get("sample_rate", 0) < 2**31:  # an int32 in Go
        raise FatalClientError(*_BAD_JSON)
    return fields


def negotiate(f: dict[str, Any], current: ClientSettings, max_msg_timeout: float) -> ClientSettings:
    """nsqd's ``clientV2.Identify`` validations, in its order; ValueError names the field."""
    hb = f.get("heartbeat_interval", 0)
    if hb == -1:
        interval = 0.0
    elif hb == 0:
        interval = current.heartbeat_interval
    elif 1000 <= hb <= int(MAX_HEARTBEAT_INTERVAL * 1000):
        interval = hb / 1000.0
    else:
        raise ValueError(f"heartbeat interval ({hb}) is invalid")
    size, timeout = current.output_buffer_size, current.output_buffer_timeout
    obt = f.get("output_buffer_timeout", 0)
    if obt == -1:
        timeout = 0.0
    elif obt == 0:
        pass
    elif int(MIN_OUTPUT_BUFFER_TIMEOUT * 1000) <= obt <= int(MAX_OUTPUT_BUFFER_TIMEOUT * 1000):
        timeout = obt / 1000.0
    else:
        raise ValueError(f"output buffer timeout ({obt}) is invalid")
    obs = f.get("output_buffer_size", 0)
    if obs == -1:
        size, timeout = 1, 0.0
    elif obs == 0:
        pass
    elif 64 <= obs <= MAX_OUTPUT_BUFFER_SIZE:
        size = obs
    else:
        raise ValueError(f"output buffer size ({obs}) is invalid")
    rate = f.get("sample_rate", 0)
    if not 0 <= rate <= 99:
        raise ValueError(f"sample rate ({rate}) is invalid")
    msg_timeout = current.msg_timeout
    mt = f.get("msg_timeout", 0)
    if mt == 0:
        pass
    elif 1000 <= mt <= int(max_msg_timeout * 1000):
        msg_timeout = mt / 1000.0
    else:
        raise ValueError(f"msg timeout ({mt}) is invalid")
    return replace(
        current,
        heartbeat_interval=interval,
        msg_timeout=msg_timeout,
        output_buffer_size=size,
        output_buffer_timeout=timeout,
        sample_rate=rate,
    )


def deflate_choice(f: dict[str, Any], enabled: bool, max_level: int) -> tuple[bool, int]:
    """``(deflate, level)`` as nsqd computes them (level 6 unless asked, capped)."""
    deflate = enabled and f.get("deflate", False)
    level = 6
    if deflate and f.get("deflate_level", 0) > 0:
        level = f["deflate_level"]
    return deflate, min(level, max_level)


def identify_reply(
    settings: ClientSettings,
    *,
    max_rdy_count: int,
    max_msg_timeout: float,
    deflate: bool,
    deflate_level: int,
    max_deflate_level: int,
    tls_v1: bool = False,
    auth_required: bool = False,
) -> bytes:
    """The feature-negotiation JSON (snappy is never offered; TLS when the server has a
    certificate and the client asked, auth when the server has an authorizer)."""
    reply = {
        "max_rdy_count": max_rdy_count,
        "version": VERSION,
        "max_msg_timeout": int(max_msg_timeout * 1000),
        "msg_timeout": int(round(settings.msg_timeout * 1000)),
        "tls_v1": tls_v1,
        "deflate": deflate,
        "deflate_level": deflate_level,
        "max_deflate_level": max_deflate_level,
        "snappy": False,
        "sample_rate": settings.sample_rate,
        "auth_required": auth_required,
        "output_buffer_size": settings.output_buffer_size,
        "output_buffer_timeout": int(round(settings.output_buffer_timeout * 1000)),
        "topology_region": "",
        "topology_zone": "",
    }
    return json.dumps(reply, separators=(",", ":")).encode()

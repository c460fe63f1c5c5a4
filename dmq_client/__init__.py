"""dmq client library.

``MqClient`` is the full, thread-safe client services embed, shaped like DMQ's
Java client: a bounded send queue and send runner, a resend map (3 resends
30 s apart by default), a notify runner that calls send callbacks, handler
threads for subscriptions, duplicate suppression, heartbeats, reconnects and
failover between servers. Configure it with ``MqConfig``; ``docs/client.md``
is the guide.

``dmq_client.aio.Client`` is the asyncio client (no threads, the same results).
``dmq_client.blocking.BlockingClient`` is the small synchronous client for
scripts, tests and benchmarks; ``dmq_client.wire`` is the sans-IO protocol
codec shared with the server; ``dmq_client.diskqueue`` is the
go-diskqueue-compatible file queue. Importing this package pulls in neither
Twisted nor psycopg.

The names below are imported on first use (PEP 562), so that the server,
which imports only ``dmq_client.wire``, does not load the client's runtime
(sockets, threads) with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same imports, eagerly, for type checkers and IDEs
    from .client import MqClient
    from .confirm import ConfirmFuture, Consumed, ConsumeStatus
    from .config import MqConfig
    from .consumer import SubscribeError, Subscription
    from .future import SendFuture
    from .message import Message, MessageType, ReceivedMessage, SendError, SendResult, Status
    from .send_queue import MemorySendQueue, SendQueue

_LAZY = {
    "ConfirmFuture": "confirm",
    "ConsumeStatus": "confirm",
    "Consumed": "confirm",
    "MemorySendQueue": "send_queue",
    "Message": "message",
    "MessageType": "message",
    "MqClient": "client",
    "MqConfig": "config",
    "ReceivedMessage": "message",
    "SendError": "message",
    "SendFuture": "future",
    "SendQueue": "send_queue",
    "SendResult": "message",
    "Status": "message",
    "SubscribeError": "consumer",
    "Subscription": "consumer",
}

__all__ = [
    "ConfirmFuture",
    "ConsumeStatus",
    "Consumed",
    "MemorySendQueue",
    "Message",
    "MessageType",
    "MqClient",
    "MqConfig",
    "ReceivedMessage",
    "SendError",
    "SendFuture",
    "SendQueue",
    "SendResult",
    "Status",
    "SubscribeError",
    "Subscription",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

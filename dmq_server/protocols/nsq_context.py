"""What all NSQ connections of a server share: the broker (the one way to either store:
it routes each topic), the limits, and the producer ids."""

from __future__ import annotations

import os
from typing import Mapping, Protocol

from dmq_server.broker.interfaces import BrokerPort
from dmq_server.core.clock import Clock
from dmq_server.core.nsq_identify import MAX_DEFLATE_LEVEL
from dmq_server.core.options import Options
from dmq_server.security.authorizer import Authorizer
from dmq_server.security.tls import ServerTls

__all__ = ["NsqClient", "NsqContext"]


class NsqClient(Protocol):
    """An NSQ connection as the server lists and closes it (``nsq_v2.NsqConnection``,
    which imports this module)."""

    @property
    def connect_ts(self) -> int: ...

    @property
    def pub_counts(self) -> Mapping[str, int]: ...

    def stats(self) -> dict[str, object]: ...

    def close(self) -> None: ...


class NsqContext:
    """What every NSQ connection of a server shares."""

    def __init__(
        self, broker: BrokerPort, options: Options, clock: Clock, *,
        tls: ServerTls | None = None, authorizer: Authorizer | None = None,
    ):
        self.broker = broker
        self.clock = clock
        self.connections: set[NsqClient] = set()
        # the options' fields, or these defaults where a test's options leave one out
        self.max_msg_size: int = getattr(options, "max_msg_size", 1024 * 1024)
        self.max_body_size: int = getattr(options, "max_body_size", 5 * 1024 * 1024)
        self.max_rdy_count: int = getattr(options, "max_rdy_count", 2500)
        self.msg_timeout: float = getattr(options, "msg_timeout", 60.0)
        self.max_msg_timeout: float = getattr(options, "max_msg_timeout", 900.0)
        self.max_req_timeout: float = getattr(options, "max_req_timeout", 3600.0)
        self.heartbeat_interval: float = getattr(options, "heartbeat_interval", 30.0)
        self.deflate: bool = getattr(options, "deflate", True)
        self.max_deflate_level: int = getattr(options, "max_deflate_level", MAX_DEFLATE_LEVEL)
        # security (dmq_server.security): the TLS context of the tls_v1 upgrade, whether
        # plaintext commands are refused, and the authorizer AUTH asks (None: auth off)
        self.tls = tls
        self.tls_required = tls is not None and getattr(options, "tls_required_mode", "false") in ("true", "tcp-https")
        self.authorizer = authorizer
        # NSQ publishers have no producer identity of their own, so this server makes
        # one: unique to this server process by a random component, which is what makes
        # the (producer, session id) pairs of two nodes (on one host, or whose 10-bit
        # snowflake node ids collide) or of two runs of one node never meet. Within the
        # process, the broker's snowflake never repeats a session id.
        self.instance = os.urandom(6).hex()
        self.http_producer = f"nsq-http@{self.instance}"

    def producer_for(self, peer: str) -> str:
        """The producer id of an NSQ TCP connection from ``peer`` (host:port): the
        peer for people to read, this process's instance for uniqueness (kept whole
        within the 64-character limit)."""
        suffix = "@" + self.instance
        return f"nsq:{peer}"[: 64 - len(suffix)] + suffix

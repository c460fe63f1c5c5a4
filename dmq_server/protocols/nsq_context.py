"""What all NSQ connections of a server share: the broker (the one way to either store:
it routes each topic), the limits, and the producer ids."""

from __future__ import annotations

import os
from typing import Any

from dmq_server.broker.interfaces import BrokerPort
from dmq_server.core.clock import Clock
from dmq_server.core.nsq_identify import MAX_DEFLATE_LEVEL
from dmq_server.core.options import Options

__all__ = ["NsqContext"]


class NsqContext:
    """What every NSQ connection of a server shares."""

    def __init__(self, broker: BrokerPort, options: Options, clock: Clock, *, tls: Any = None, authorizer: Any = None):
        def opt(name: str, default: Any) -> Any:
            return getattr(options, name, default)

        self.broker = broker
        self.clock = clock
        self.connections: set[Any] = set()
        self.max_msg_size = opt("max_msg_size", 1024 * 1024)
        self.max_body_size = opt("max_body_size", 5 * 1024 * 1024)
        self.max_rdy_count = opt("max_rdy_count", 2500)
        self.msg_timeout = opt("msg_timeout", 60.0)
        self.max_msg_timeout = opt("max_msg_timeout", 900.0)
        self.max_req_timeout = opt("max_req_timeout", 3600.0)
        self.heartbeat_interval = opt("heartbeat_interval", 30.0)
        self.deflate = opt("deflate", True)
        self.max_deflate_level = opt("max_deflate_level", MAX_DEFLATE_LEVEL)
        # security (dmq_server.security): the TLS context of the tls_v1 upgrade, whether
        # plaintext commands are refused, and the authorizer AUTH asks (None: auth off)
        self.tls = tls
        self.tls_required = tls is not None and opt("tls_required_mode", "false") in ("true", "tcp-https")
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

"""Every client setting, in one frozen dataclass with documented defaults.

The defaults are DMQ's (3 resends 30 s apart, checked every second, 64 KiB
bodies) and suit a service in production; tests shorten the times. Servers are
a fixed list today; registry discovery (ZooKeeper) will arrive as further
fields of this same class, so code that builds an ``MqConfig`` keeps working.

``docs/client.md`` has the configuration reference; it is the same text as the
``help`` metadata below, which a test keeps in step.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the otel extra: imported by the type checker only
    from opentelemetry.trace import TracerProvider

    from .pending import SendCallback

__all__ = ["MqConfig", "parse_server"]


def parse_server(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (``":PORT"`` means 127.0.0.1; ``[::1]:PORT`` for IPv6)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"invalid server address {text!r}, expected HOST:PORT")
    return (host.strip("[]") or "127.0.0.1"), int(port)


def _opt(default: Any, help: str) -> Any:
    if isinstance(default, (list, tuple)):
        return field(default=tuple(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class MqConfig:
    """Settings of one ``MqClient``. Times are in seconds."""

    servers: tuple[str, ...] = _opt(
        ("127.0.0.1:4150",), "dmq servers as HOST:PORT; the client connects to every one"
    )
    producer_id: str = _opt(
        "", "producer id (1-64 ASCII), unique among live clients; empty: a new one per client (host, pid, random)"
    )
    send_queue_size: int = _opt(
        10000, "messages accepted but not yet written; a send beyond this gets QUEUE_FULL at once"
    )
    max_in_flight: int = _opt(
        10000, "messages written and awaiting a reply (the resend map); the send runner waits for room"
    )
    max_body_size: int = _opt(65536, "largest body the client accepts, in bytes (DMQ: 64 KiB)")
    resend_interval: float = _opt(30.0, "time without a reply before a message is resent")
    resend_tries: int = _opt(3, "resends before OUT_OF_RETRY (each with UP_PRODUCER_RESEND)")
    resend_check_interval: float = _opt(1.0, "how often the resend runner scans the resend map")
    route_wait: float = _opt(
        5.0, "how long a send waits for a usable server connection before SOCKET_ERROR"
    )
    connect_timeout: float = _opt(5.0, "TCP connect plus the server's SERVER_HEALTH greeting")
    write_timeout: float = _opt(10.0, "longest a blocked socket write may take before the connection is dropped")
    heartbeat_interval: float = _opt(
        10.0, "UP_HEARTBEAT when nothing was written for this long (capped at half the server's interval)"
    )
    server_silence_timeout: float = _opt(
        60.0, "drop a connection silent this long until the server announces its heartbeat interval (then 2x that)"
    )
    reconnect_backoff: float = _opt(0.1, "first delay before reconnecting; doubles per failure")
    reconnect_backoff_max: float = _opt(10.0, "longest delay between reconnect attempts")
    send_batch_size: int = _opt(256, "most frames the send runner writes in one socket write")
    handler_threads: int = _opt(4, "threads calling handlers' on_message")
    ack_wait: float = _opt(
        0.005, "longest a handler thread's ack is held while more messages wait, to go with others in one "
        "UP_CONSUMER_ACKS frame; 0 = every ack written at once"
    )
    default_credit: int = _opt(100, "unacknowledged pushes per subscription and server (subscribe credit)")
    subscribe_timeout: float = _opt(10.0, "how long subscribe() waits for the servers' answers")
    dedup_max_entries: int = _opt(50000, "pushes remembered for duplicate suppression (size bound)")
    dedup_max_age: float = _opt(600.0, "how long a push is remembered for duplicate suppression (age bound)")
    close_timeout: float = _opt(
        10.0, "how long close() waits for queued and unanswered sends before reporting them CLIENT_CLOSED"
    )
    journal_path: str | None = _opt(
        None, "directory of the producer journal (created if missing); None = off, accepted sends live in memory only"
    )
    journal_sync_every: int = _opt(
        1, "fsync the journal every this many sends; 1 = send() returns only once its message is on disk"
    )
    journal_sync_interval: float = _opt(
        1.0, "longest an unsynced send or finished result waits for the journal's fsync"
    )
    journal_retry_backoff: float = _opt(
        1.0, "with the journal: first wait before a journaled send that failed transiently is tried again; doubles"
    )
    journal_retry_backoff_max: float = _opt(30.0, "with the journal: longest wait between those tries")
    journal_give_up_after: float | None = _opt(
        None, "with the journal: after failing this long, report the failure and forget the message; None = never"
    )
    recovered_callback: SendCallback | None = _opt(
        None, "gets the results of messages recovered from the journal at start; None = they are only logged"
    )
    zk: str = _opt(
        "", "ZooKeeper HOST:PORT[,...][/chroot] of a dmq cluster: servers are discovered there and `servers` is ignored"
    )
    zk_session_timeout: float = _opt(10.0, "the client's ZooKeeper session timeout (discovery only)")
    zk_refresh_interval: float = _opt(
        3600.0, "full re-read of the registry besides its watches (DMQ: every hour)"
    )
    tls: bool = _opt(
        False, "connect with TLS (the servers' --tls-address ports); the server's certificate and name are verified"
    )
    tls_ca_file: str | None = _opt(None, "PEM CA certificates the server's certificate is verified against; None = the system's")
    tls_cert_file: str | None = _opt(None, "PEM client certificate (chain) presented when the server asks for one")
    tls_key_file: str | None = _opt(None, "PEM private key of tls_cert_file (None: it is in that file)")
    tls_server_name: str | None = _opt(
        None, "the name the server's certificate must carry; None = the host of each server address"
    )
    auth_secret: str | None = _opt(
        None, "secret sent with UP_AUTH on every connection (servers with --auth-file or --auth-http-address); "
        "\"\" = authenticate by the client certificate"
    )
    tracer_provider: TracerProvider | None = _opt(
        None, "with the otel extra: the OpenTelemetry TracerProvider of the send and process spans; None = the global one"
    )

    def __post_init__(self) -> None:
        if isinstance(self.servers, str):
            object.__setattr__(self, "servers", tuple(s for s in self.servers.split(",") if s.strip()))
        else:
            object.__setattr__(self, "servers", tuple(self.servers))
        if self.journal_path is not None and isinstance(self.journal_path, os.PathLike):
            object.__setattr__(self, "journal_path", os.fspath(self.journal_path))
        self.validate()

    def validate(self) -> "MqConfig":
        """Fail at construction, naming the field, rather than misbehave later."""
        if self.zk:
            from registry.paths import parse_address as parse_zk_address

            try:
                parse_zk_address(self.zk)
            except (ValueError, AttributeError) as exc:
                raise ValueError(f"zk: {exc}") from None
        elif not self.servers:
            raise ValueError("servers: at least one HOST:PORT is required")
        for server in self.servers:
            try:
                parse_server(server)
            except (ValueError, AttributeError) as exc:
                raise ValueError(f"servers: {exc}") from None
        if self.producer_id and (len(self.producer_id) > 64 or not self.producer_id.isascii()):
            raise ValueError("producer_id: must be 1-64 ASCII characters")
        positive_ints = (
            "send_queue_size",
            "max_in_flight",
            "max_body_size",
            "send_batch_size",
            "handler_threads",
            "default_credit",
            "dedup_max_entries",
        )
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, not {value!r}")
        if not isinstance(self.resend_tries, int) or self.resend_tries < 0:
            raise ValueError(f"resend_tries: must be an integer >= 0, not {self.resend_tries!r}")
        positive_times = (
            "zk_session_timeout",
            "zk_refresh_interval",
            "resend_interval",
            "resend_check_interval",
            "connect_timeout",
            "write_timeout",
            "heartbeat_interval",
            "server_silence_timeout",
            "reconnect_backoff",
            "reconnect_backoff_max",
            "dedup_max_age",
            "journal_retry_backoff",
            "journal_retry_backoff_max",
        )
        for name in positive_times:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name}: must be a positive number of seconds, not {value!r}")
        if self.journal_path is not None and (not isinstance(self.journal_path, str) or not self.journal_path):
            raise ValueError(f"journal_path: must be a directory path or None, not {self.journal_path!r}")
        if not isinstance(self.journal_sync_every, int) or self.journal_sync_every < 1:
            raise ValueError(f"journal_sync_every: must be a positive integer, not {self.journal_sync_every!r}")
        if not isinstance(self.journal_sync_interval, (int, float)) or self.journal_sync_interval <= 0:
            raise ValueError(
                f"journal_sync_interval: must be a positive number of seconds, not {self.journal_sync_interval!r}"
            )
        give_up = self.journal_give_up_after
        if give_up is not None and (not isinstance(give_up, (int, float)) or isinstance(give_up, bool) or give_up < 0):
            raise ValueError(f"journal_give_up_after: must be None or >= 0 seconds, not {give_up!r}")
        callback = self.recovered_callback
        if callback is not None and not (callable(callback) or callable(getattr(callback, "on_result", None))):
            raise ValueError("recovered_callback: must be None, a callable or an object with on_result(result)")
        if (self.tls_cert_file or self.tls_ca_file or self.tls_key_file or self.tls_server_name) and not self.tls:
            raise ValueError("tls_ca_file, tls_cert_file, tls_key_file and tls_server_name need tls=True")
        if self.tls_key_file and not self.tls_cert_file:
            raise ValueError("tls_key_file: needs tls_cert_file")
        if self.auth_secret is not None and not isinstance(self.auth_secret, str):
            raise ValueError(f"auth_secret: must be a string or None, not {type(self.auth_secret).__name__}")
        for name in ("route_wait", "subscribe_timeout", "close_timeout", "ack_wait"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name}: must be >= 0 seconds, not {value!r}")
        return self

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [parse_server(s) for s in self.servers]

    def replace(self, **changes: Any) -> "MqConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def reference(cls) -> list[tuple[str, Any, str]]:
        """(name, default, help) of every setting, for the docs."""
        return [(f.name, f.default, f.metadata["help"]) for f in dataclasses.fields(cls)]

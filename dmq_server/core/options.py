"""Every server setting, in one dataclass with documented defaults.

The command-line flags (nsqd's names where the two overlap), the ``DMQ_*``
environment variables, the TOML config file and ``deploy/dmq.conf.example`` are
all generated from the fields below, so a setting cannot exist in one place and
not the others. Precedence: flag > environment > config file > default.

The config file is named by ``--config PATH`` or ``DMQ_CONFIG``. It is TOML whose
keys are the field names (``mem_queue_size = 20000``); durations are strings such
as ``"250ms"``, ``"30s"``, ``"5m"``, ``"1h"`` or plain numbers of seconds
(``dmq_client.spelling``, the spellings every dmq tool shares). An
unknown key or a bad value is an error that names the file and the key.

The commented example config is rendered from the fields' metadata::

    python -m dmq_server.core.options --example > deploy/dmq.conf.example

Run that after adding or changing a field; ``tests/unit/test_options.py`` fails
while the committed example differs from what the dataclass renders.

Why one long module: it is the one settings type by design (every field with its help,
flag, variable and config key) and the parsing and rendering generated from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
import textwrap
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

from dmq_client.spelling import format_duration, parse_address, parse_duration
from dmq_server.core.outbox_rows import parse_outbox

__all__ = [
    "Options",
    "MAIN_CLUSTER",
    "MAX_CLUSTERS",
    "check_cluster_name",
    "ConfigError",
    "build_parser",
    "options_from_args",
    "load_config",
    "parse_config",
    "render_example",
    "flag_name",
    "env_name",
]

CONFIG_ENV = "DMQ_CONFIG"
LOG_LEVELS = ("debug", "info", "warn", "error")
LOG_FORMATS = ("text", "json")
DB_IO = ("reactor", "threads")
TLS_CLIENT_POLICIES = ("", "require", "require-verify", "verify-if-given")
TLS_REQUIRED = ("false", "true", "tcp-https")
TLS_VERSIONS = ("tls1.0", "tls1.1", "tls1.2", "tls1.3")


class ConfigError(ValueError):
    """A setting from a flag, a variable or the config file that cannot be used."""


# a setting's value, by its field's kind: str, int, duration (float seconds), bool, list
Setting = str | int | float | bool | tuple[str, ...]
T = TypeVar("T")


def _opt(default: T, help: str, *, kind: str = "str", flag: str | None = None) -> T:
    return field(default=default, metadata={"help": help, "kind": kind, "flag": flag})


@dataclass(frozen=True)
class Options:
    """dmq server options. Field names map to ``--flag-name``, ``DMQ_FIELD_NAME`` and
    the config file key ``field_name``."""

    data_path: str = _opt("./dmq-data", "directory for the embedded PostgreSQL and local state")
    tcp_address: str = _opt("127.0.0.1:4150", "HOST:PORT for the TCP protocols (dmq and NSQ)")
    http_address: str = _opt(
        "127.0.0.1:4151", "HOST:PORT for the HTTP API (/ping, /stats, nsqd and lookup APIs)"
    )
    pg_dsn: str = _opt(
        "", "PostgreSQL DSN; empty starts a private PostgreSQL under --data-path"
    )
    pg_cluster: tuple[str, ...] = _opt(
        (),
        "another PostgreSQL cluster topics may be placed on, as NAME=DSN (repeat the flag; in "
        "the environment one per line or separated by ';'); the default cluster 'main' is "
        "--pg-dsn or the embedded PostgreSQL (docs/operations.md#several-postgresql-clusters)",
        kind="list",
    )
    outbox: tuple[str, ...] = _opt(
        (),
        "an application database's outbox to relay into topics, as NAME=APP_DSN or "
        "NAME:SCHEMA=APP_DSN (schema dmq_outbox by default; repeat the flag; in the environment "
        "one per line or separated by ';'); docs/client.md#transactional-messages",
        kind="list",
    )
    pg_timeout: float = _opt(
        15.0,
        "longest wait for PostgreSQL to answer a statement (a commit included); past it the "
        "connection is dropped as hung and the outcome taken as unknown (0 = wait forever)",
        kind="duration",
    )
    node_id: str = _opt("", "this node's id; empty derives it from the host name and TCP port")
    max_msg_size: int = _opt(1048576, "largest message body accepted, in bytes", kind="int")
    msg_timeout: float = _opt(
        60.0, "default time before an unacknowledged push is redelivered", kind="duration"
    )
    heartbeat_interval: float = _opt(
        30.0,
        "interval of SERVER_HEARTBEAT; a client silent for twice this is disconnected",
        kind="duration",
    )
    default_credit: int = _opt(
        100, "unacknowledged pushes per subscription when the client asks for 0", kind="int"
    )
    max_credit: int = _opt(2500, "largest credit a subscription may ask for", kind="int")
    mem_queue_size: int = _opt(
        10000,
        "messages per channel kept in memory; the rest wait in PostgreSQL",
        kind="int",
    )
    commit_batch_size: int = _opt(
        2000, "most messages stored in one group-commit transaction", kind="int"
    )
    commit_writers: int = _opt(
        2,
        "group-commit transactions in progress at once, each on its own connection (a further "
        "one starts only once 64 sends wait)",
        kind="int",
    )
    commit_interval: float = _opt(
        0.0015,
        "shortest time between the starts of two group commits while fewer than 64 sends "
        "wait: fewer, fuller commits at moderate rates (a send waits at most this less the "
        "commit's round trip; a send to an idle writer never waits; 0: no wait)",
        kind="duration",
    )
    db_io: str = _opt(
        "reactor",
        "how the send group commit and the acker reach PostgreSQL: reactor (non-blocking "
        "connections read by the event loop) or threads (a thread per connection)",
    )
    ack_batch_size: int = _opt(5000, "most acknowledgements made durable in one transaction", kind="int")
    ack_flush_interval: float = _opt(
        0.01, "how long acknowledgements may wait to be batched", kind="duration"
    )
    registry_refresh: float = _opt(
        2.0, "how often topics and channels are re-read from the registry", kind="duration"
    )
    message_retention: float = _opt(
        600.0,
        "how long a fully acknowledged message is kept (resend idempotency window), unless its "
        "topic has a retention of its own (dmq topic create/update --retention)",
        kind="duration",
    )
    channel_state_interval: float = _opt(
        5.0,
        "how often reliable channels' stored depth and operator pauses are re-read from PostgreSQL",
        kind="duration",
    )
    sweep_interval: float = _opt(
        30.0, "how often fully acknowledged messages past retention are removed", kind="duration"
    )
    owner_silence: float = _opt(
        30.0,
        "without --zk: how long another server on the database may miss its heartbeat (every "
        "sixth of this) before its stored messages are delivered as taken over and it is fenced",
        kind="duration",
    )
    scan_interval: float = _opt(
        0.1, "how often in-flight deadlines are checked", kind="duration"
    )
    shutdown_timeout: float = _opt(
        30.0, "longest a graceful shutdown waits for batches to commit", kind="duration"
    )
    log_level: str = _opt("info", "debug, info, warn or error")
    # -- observability: logs, /metrics, the message trace (docs/observability.md) ------------
    log_format: str = _opt("text", "text (a line per event) or json (a JSON object per line, with topic, "
                           "channel, node and message id fields where they apply)")
    metrics_db_interval: float = _opt(
        15.0, "how often /metrics' gauges that need PostgreSQL (oldest unacknowledged message, delayed "
        "messages, stored dead letters, round-trip time) are read; never during a scrape", kind="duration"
    )
    trace_retention: float = _opt(
        604800.0, "how long the message trace keeps deliveries that came back unacknowledged", kind="duration"
    )
    # -- bounds: backpressure and timeouts on every port (dmq_server/protocols/flow.py) -------
    max_output_buffer: int = _opt(
        65536,
        "unsent bytes to one TCP client at which the server stops reading it until they are "
        "sent (backpressure on clients that do not read their replies); also the most read "
        "from one connection at once",
        kind="int",
    )
    max_pending_sends: int = _opt(
        10000,
        "sends (NSQ: PUB, MPUB, DPUB) one TCP connection may have awaiting their answer "
        "before the server stops reading it",
        kind="int",
    )
    max_pending_bytes: int = _opt(
        8388608,
        "bytes of message bodies one TCP connection may have awaiting their answer before "
        "the server stops reading it",
        kind="int",
    )
    max_buffered_bytes: int = _opt(
        67108864,
        "bytes all TCP connections together may hold in incomplete frames and sends awaiting "
        "their answer; above it connections holding any wait until it is under three quarters",
        kind="int",
    )
    max_client_memory: int = _opt(
        268435456,
        "bytes the server may hold on its clients' behalf, all kinds together: incomplete "
        "frames, sends awaiting their commit, unread replies and pushes, and the channels' "
        "memory windows (reliable and fast); over it the connections holding any are not "
        "read until it is under three quarters (docs/operations.md, Memory)",
        kind="int",
    )
    read_timeout: float = _opt(
        30.0,
        "longest an incomplete frame (TCP) or request (HTTP) may take to arrive once it has "
        "started; then the connection is closed (0 disables)",
        kind="duration",
    )
    http_idle_timeout: float = _opt(
        300.0, "an HTTP keep-alive connection idle this long is closed (0 disables)", kind="duration"
    )
    admin_idle_timeout: float = _opt(
        900.0,
        "an admin console session with no command for this long is closed (0 disables)",
        kind="duration",
    )
    # -- the NSQ protocol and the fast store (nsqd's names and defaults) ----------
    max_msg_timeout: float = _opt(
        900.0, "longest message timeout an NSQ client may ask for (IDENTIFY, TOUCH)", kind="duration"
    )
    max_req_timeout: float = _opt(
        3600.0, "longest delay of an NSQ REQ or DPUB (and /pub?defer), and of a dmq UP_CONSUMER_REQUEUE", kind="duration"
    )
    max_body_size: int = _opt(5242880, "largest body of an NSQ MPUB or /mpub, in bytes", kind="int")
    max_rdy_count: int = _opt(2500, "largest RDY count an NSQ client may send", kind="int")
    max_channel_consumers: int = _opt(
        0, "most consumers on one fast channel (0 = unlimited)", kind="int"
    )
    sync_every: int = _opt(
        2500, "fast store disk queues fsync after this many writes and reads", kind="int"
    )
    sync_timeout: float = _opt(
        2.0, "fast store disk queues fsync at least this often when busy", kind="duration"
    )
    max_bytes_per_file: int = _opt(
        104857600, "size at which a fast store disk-queue file rolls over", kind="int"
    )
    broadcast_address: str = _opt(
        "", "address announced to NSQ clients by the lookup API; empty means the host name"
    )
    deflate: bool = _opt(True, "allow NSQ clients to negotiate deflate compression", kind="bool")
    max_deflate_level: int = _opt(6, "highest deflate level an NSQ client may ask for", kind="int")
    # -- delayed messages, limits, dead letters, admin ------------------------------
    delay_fragments: int = _opt(
        8, "fragments delayed messages are spread over (each gets a random one, 1..N)", kind="int"
    )
    delay_workers: int = _opt(
        2,
        "delay workers on this node; each serves a contiguous run of the node's fragments",
        kind="int",
    )
    delay_poll_interval: float = _opt(
        1.0,
        "how often a delay worker reads the due times of the next window (held on timers)",
        kind="duration",
    )
    delay_tick: float = _opt(
        0.01, "shortest gap between two moves of due messages by one delay worker", kind="duration"
    )
    delay_batch_size: int = _opt(
        2000, "most delayed messages moved into the reliable flow in one transaction", kind="int"
    )
    max_delay: float = _opt(
        2592000.0, "longest a DELAY message may wait (due_ms at most this far ahead)", kind="duration"
    )
    expiry_interval: float = _opt(
        1.0,
        "how often copies not acknowledged within their topic's time to live become dead letters",
        kind="duration",
    )
    admin_address: str = _opt(
        "127.0.0.1:4152", "HOST:PORT of the line-based admin console (telnet, nc); empty disables it"
    )
    admin_token: str = _opt(
        "",
        "token the admin console and the HTTP admin API require (always when set; without one "
        "they refuse everything when listening on a non-loopback address)",
    )
    # -- security: TLS on every listener, authentication, authorization (docs/operations.md) --
    tls_cert: str = _opt(
        "",
        "PEM certificate (chain) of this server; with --tls-key it enables TLS: NSQ's tls_v1 "
        "upgrade on the TCP port, --tls-address and --https-address (re-read on SIGHUP)",
    )
    tls_key: str = _opt("", "PEM private key of --tls-cert (re-read on SIGHUP)")
    tls_root_ca_file: str = _opt(
        "",
        "PEM CA certificates that client certificates are verified against (and the auth "
        "server's, over https)",
    )
    tls_client_auth_policy: str = _opt(
        "",
        "client certificates: empty (none asked), require (any certificate, not verified), "
        "require-verify (verified against --tls-root-ca-file) or verify-if-given (optional, "
        "verified when sent); require and require-verify imply --tls-required true",
    )
    tls_required: str = _opt(
        "false",
        "true: plaintext is refused (NSQ commands before the tls_v1 upgrade, the dmq protocol "
        "on the TCP port, plain HTTP but /ping); tcp-https: TCP only; false: TLS is optional",
    )
    tls_min_version: str = _opt("tls1.2", "oldest TLS version accepted: tls1.0, tls1.1, tls1.2 or tls1.3")
    tls_handshake_timeout: float = _opt(
        5.0, "a TLS handshake not finished this long after it started closes the connection", kind="duration"
    )
    tls_address: str = _opt(
        "", "HOST:PORT of a TCP port speaking TLS from the first byte (both protocols); empty disables it"
    )
    https_address: str = _opt("", "HOST:PORT of the HTTP API over TLS; empty disables it")
    auth_http_address: str = _opt(
        "",
        "auth servers (HOST:PORT or URLs, comma-separated) asked as nsqd asks them: "
        "GET /auth?remote_ip=&tls=&secret=&common_name=; setting one turns authentication on",
    )
    auth_http_request_method: str = _opt("get", "how the auth server is asked: get or post")
    auth_file: str = _opt(
        "",
        "JSON file of secrets and certificate names, each with an auth server's answer "
        "(re-read on SIGHUP); setting it turns authentication on",
    )
    http_client_connect_timeout: float = _opt(2.0, "connect timeout of requests to the auth server", kind="duration")
    http_client_request_timeout: float = _opt(5.0, "longest a request to the auth server may take", kind="duration")
    http_open_reads: bool = _opt(
        False,
        "with authentication on, HTTP reads (GET /stats, /info, /metrics, the lookup API) need "
        "no credential; the admin API and every change still do",
        kind="bool",
    )
    admin_tls: bool = _opt(
        False,
        "the admin console speaks TLS with the server's certificate (openssl s_client -connect HOST:PORT); "
        "needs --tls-cert",
        kind="bool",
    )
    # -- cluster: ZooKeeper registry, heartbeat, takeover ---------------------------
    zk: str = _opt(
        "",
        "ZooKeeper ensemble HOST:PORT[,HOST:PORT...][/chroot] holding the cluster registry; "
        "empty runs a single node with its registry in PostgreSQL",
    )
    zk_session_timeout: float = _opt(
        10.0,
        "ZooKeeper session timeout: a node silent this long is gone and its messages are taken over",
        kind="duration",
    )
    zk_connect_timeout: float = _opt(
        30.0,
        "how long the server retries ZooKeeper at start before it exits with an error",
        kind="duration",
    )
    node_heartbeat: float = _opt(
        30.0, "how often this node refreshes its registration (last heartbeat) in ZooKeeper", kind="duration"
    )
    zk_refresh: float = _opt(
        60.0,
        "full re-read of the ZooKeeper registry and check for departed nodes' messages "
        "(watches apply changes at once; this is the safety net)",
        kind="duration",
    )
    zk_sasl_user: str = _opt("", "SASL DIGEST-MD5 user for ZooKeeper (with --zk-sasl-password); empty: no SASL")
    zk_sasl_password: str = _opt("", "SASL DIGEST-MD5 password for ZooKeeper (better in the config file or DMQ_ZK_SASL_PASSWORD)")
    zk_tls_ca_file: str = _opt("", "connect to ZooKeeper with TLS, verifying it against these PEM CAs; empty: plaintext")
    zk_tls_cert: str = _opt("", "PEM client certificate for ZooKeeper's TLS client authentication")
    zk_tls_key: str = _opt("", "PEM key of --zk-tls-cert")
    takeover_batch_size: int = _opt(
        5000, "most of a departed node's messages claimed in one transaction", kind="int"
    )
    ordered_poll: float = _opt(
        0.05,
        "with --zk: how often the node delivering an ordered topic (its orderer) reads, for each "
        "of the topic's channels with consumers, the messages other nodes stored since its last read",
        kind="duration",
    )

    # -- derived helpers -------------------------------------------------
    @property
    def tcp_endpoint(self) -> tuple[str, int]:
        return parse_address(self.tcp_address)

    @property
    def http_endpoint(self) -> tuple[str, int]:
        return parse_address(self.http_address)

    @property
    def admin_endpoint(self) -> tuple[str, int] | None:
        return parse_address(self.admin_address) if self.admin_address else None

    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls_cert)

    @property
    def auth_enabled(self) -> bool:
        return bool(self.auth_http_address or self.auth_file)

    @property
    def tls_required_mode(self) -> str:
        """``true``, ``tcp-https`` or ``false``; a client certificate policy that needs a
        certificate implies ``true`` (nsqd's rule)."""
        if self.tls_required == "false" and self.tls_client_auth_policy in ("require", "require-verify"):
            return "true"
        return self.tls_required

    @property
    def zk_security(self) -> dict[str, object]:
        """kazoo's keyword arguments for SASL and TLS (``registry.zk.make_client``)."""
        out: dict[str, object] = {}
        if self.zk_sasl_user:
            out["sasl_options"] = {"mechanism": "DIGEST-MD5", "username": self.zk_sasl_user, "password": self.zk_sasl_password}
        if self.zk_tls_ca_file:
            out.update(use_ssl=True, verify_certs=True, ca=self.zk_tls_ca_file)
            if self.zk_tls_cert:
                out.update(certfile=self.zk_tls_cert, keyfile=self.zk_tls_key or None)
        return out

    @property
    def auth_http_addresses(self) -> tuple[str, ...]:
        return tuple(a.strip() for a in self.auth_http_address.split(",") if a.strip())

    @property
    def pg_clusters(self) -> dict[str, str]:
        """The clusters of ``--pg-cluster`` by name (without ``main``), in flag order;
        ``validate`` has checked their spelling."""
        return dict(_cluster_entry(entry) for entry in self.pg_cluster)

    @property
    def data_dir(self) -> Path:
        return Path(self.data_path).resolve()

    def replace(self, **changes: Any) -> "Options":
        return dataclasses.replace(self, **changes)

    def validate(self) -> "Options":
        """Fail early, naming the flag and config key, on values the server cannot use."""
        optional = ("admin_address", "tls_address", "https_address")
        names = ("tcp_address", "http_address") + tuple(n for n in optional if getattr(self, n))
        for name in names:
            try:
                parse_address(getattr(self, name))
            except ValueError as exc:
                raise ConfigError(f"{_names(name)}: {exc}") from None
        if self.zk:
            from registry.paths import parse_address as parse_zk_address

            try:
                parse_zk_address(self.zk)
            except ValueError as exc:
                raise ConfigError(f"{_names('zk')}: {exc}") from None
        seen: set[str] = set()
        for entry in self.pg_cluster:
            try:
                name, _ = _cluster_entry(entry)
            except ValueError as exc:
                raise ConfigError(f"{_names('pg_cluster')}: {exc}") from None
            if name in seen:
                raise ConfigError(f"{_names('pg_cluster')}: cluster {name!r} is given twice")
            seen.add(name)
        outboxes: set[str] = set()
        for entry in self.outbox:
            try:
                source = parse_outbox(entry)
            except ValueError as exc:
                raise ConfigError(f"{_names('outbox')}: {exc}") from None
            if source.name in outboxes:
                raise ConfigError(f"{_names('outbox')}: outbox {source.name!r} is given twice")
            outboxes.add(source.name)
        if len(seen) >= MAX_CLUSTERS:
            raise ConfigError(f"{_names('pg_cluster')}: at most {MAX_CLUSTERS - 1} clusters besides {MAIN_CLUSTER!r}")
        checks = [
            ("max_msg_size", self.max_msg_size >= 1, "must be at least 1"),
            ("msg_timeout", self.msg_timeout > 0, "must be more than 0"),
            ("pg_timeout", self.pg_timeout >= 0, "must be 0 or more"),
            ("heartbeat_interval", self.heartbeat_interval > 0, "must be more than 0"),
            ("max_credit", self.max_credit >= 1, "must be at least 1"),
            ("default_credit", 1 <= self.default_credit <= self.max_credit, "must be 1..max_credit"),
            ("mem_queue_size", self.mem_queue_size >= 1, "must be at least 1 (reliable channels push from this memory window; see docs/nsq.md)"),
            ("commit_batch_size", self.commit_batch_size >= 1, "must be at least 1"),
            ("commit_writers", self.commit_writers >= 1, "must be at least 1"),
            ("commit_interval", 0 <= self.commit_interval <= 1, "must be 0..1s"),
            ("db_io", self.db_io in DB_IO, "must be one of " + ", ".join(DB_IO)),
            ("ack_batch_size", 1 <= self.ack_batch_size <= 1 << 20,
             "must be 1..1048576 (one dmq_delivery_batch row holds at most 2^20 facts)"),
            ("registry_refresh", self.registry_refresh > 0, "must be more than 0"),
            ("sweep_interval", self.sweep_interval > 0, "must be more than 0"),
            ("owner_silence", self.owner_silence > 0, "must be more than 0"),
            ("channel_state_interval", self.channel_state_interval > 0, "must be more than 0"),
            ("scan_interval", self.scan_interval > 0, "must be more than 0"),
            ("log_level", self.log_level in LOG_LEVELS, "must be one of " + ", ".join(LOG_LEVELS)),
            ("log_format", self.log_format in LOG_FORMATS, "must be one of " + ", ".join(LOG_FORMATS)),
            ("metrics_db_interval", self.metrics_db_interval > 0, "must be more than 0"),
            ("trace_retention", self.trace_retention > 0, "must be more than 0"),
            ("max_output_buffer", self.max_output_buffer >= 1024, "must be at least 1024"),
            ("max_pending_sends", self.max_pending_sends >= 1, "must be at least 1"),
            ("max_pending_bytes", self.max_pending_bytes >= 1, "must be at least 1"),
            (
                "max_buffered_bytes",
                self.max_buffered_bytes >= max(self.max_msg_size, self.max_body_size),
                "must be at least --max-msg-size and --max-body-size: one whole frame must fit",
            ),
            (
                "max_client_memory",
                self.max_client_memory >= max(16 << 20, 4 * max(self.max_msg_size, self.max_body_size)),
                "must be at least 16 MiB and four times --max-msg-size and --max-body-size",
            ),
            ("delay_fragments", 1 <= self.delay_fragments <= 32767, "must be 1..32767"),
            ("delay_workers", self.delay_workers >= 1, "must be at least 1"),
            ("delay_poll_interval", self.delay_poll_interval > 0, "must be more than 0"),
            ("delay_batch_size", self.delay_batch_size >= 1, "must be at least 1"),
            ("max_delay", self.max_delay > 0, "must be more than 0"),
            ("expiry_interval", self.expiry_interval > 0, "must be more than 0"),
            ("zk_session_timeout", self.zk_session_timeout >= 1, "must be at least 1s"),
            ("zk_connect_timeout", self.zk_connect_timeout > 0, "must be more than 0"),
            ("node_heartbeat", self.node_heartbeat > 0, "must be more than 0"),
            ("zk_refresh", self.zk_refresh > 0, "must be more than 0"),
            ("takeover_batch_size", self.takeover_batch_size >= 1, "must be at least 1"),
            ("ordered_poll", self.ordered_poll > 0, "must be more than 0"),
        ]
        checks += self._security_checks()
        for name, ok, rule in checks:
            if not ok:
                raise ConfigError(f"{_names(name)}: invalid value {getattr(self, name)!r} ({rule})")
        return self


    def _security_checks(self) -> list[tuple[str, bool, str]]:
        needs_cert = (
            self.tls_address or self.https_address or self.tls_client_auth_policy or self.tls_required != "false"
            or self.admin_tls
        )
        return [
            ("tls_key", bool(self.tls_cert) == bool(self.tls_key), "--tls-cert and --tls-key go together"),
            ("tls_cert", bool(self.tls_cert) or not needs_cert,
             "needed by --tls-address, --https-address, --tls-required, --tls-client-auth-policy and --admin-tls"),
            ("tls_client_auth_policy", self.tls_client_auth_policy in TLS_CLIENT_POLICIES,
             "must be empty or one of " + ", ".join(p for p in TLS_CLIENT_POLICIES if p)),
            ("tls_client_auth_policy",
             self.tls_client_auth_policy in ("", "require") or bool(self.tls_root_ca_file),
             "verifying client certificates needs --tls-root-ca-file"),
            ("tls_required", self.tls_required in TLS_REQUIRED, "must be one of " + ", ".join(TLS_REQUIRED)),
            ("tls_min_version", self.tls_min_version in TLS_VERSIONS, "must be one of " + ", ".join(TLS_VERSIONS)),
            ("tls_handshake_timeout", self.tls_handshake_timeout > 0, "must be more than 0"),
            ("auth_file", not (self.auth_file and self.auth_http_address),
             "use --auth-file or --auth-http-address, not both"),
            ("auth_http_request_method", self.auth_http_request_method in ("get", "post"), "must be get or post"),
            ("http_client_connect_timeout", self.http_client_connect_timeout > 0, "must be more than 0"),
            ("http_client_request_timeout", self.http_client_request_timeout > 0, "must be more than 0"),
            ("zk_sasl_password", bool(self.zk_sasl_user) or not self.zk_sasl_password, "needs --zk-sasl-user"),
            ("zk_tls_cert", bool(self.zk_tls_ca_file) or not self.zk_tls_cert, "needs --zk-tls-ca-file"),
        ]


# -- names -------------------------------------------------------------------
_FIELDS = {f.name: f for f in dataclasses.fields(Options)}


#: the name of the default cluster (``--pg-dsn`` or the embedded PostgreSQL)
MAIN_CLUSTER = "main"
#: how many clusters there may be: each owns a range of message ids (``db.clusters``)
MAX_CLUSTERS = 32
_CLUSTER_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-")


def check_cluster_name(name: str) -> str | None:
    """Why ``name`` cannot name a cluster, or None (lower-case letters, digits, ``_`` and
    ``-``, at most 32: it is a label value of ``/metrics`` and a ZooKeeper node name)."""
    if not name or len(name) > 32 or not set(name) <= _CLUSTER_NAME_CHARS:
        return f"cluster name {name!r} must be 1 to 32 lower-case letters, digits, '_' or '-'"
    return None


def _cluster_entry(entry: str) -> tuple[str, str]:
    name, sep, dsn = entry.partition("=")
    name, dsn = name.strip(), dsn.strip()
    if not sep or not dsn:
        raise ValueError(f"expected NAME=DSN, got {entry!r}")
    why = check_cluster_name(name)
    if why is not None:
        raise ValueError(why)
    if name == MAIN_CLUSTER:
        raise ValueError(f"cluster {MAIN_CLUSTER!r} is --pg-dsn (or the embedded PostgreSQL): name the others")
    return name, dsn


def flag_name(name: str) -> str:
    """The command-line flag of a field: ``--mem-queue-size``."""
    return _FIELDS[name].metadata.get("flag") or "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    """The environment variable of a field: ``DMQ_MEM_QUEUE_SIZE``."""
    return "DMQ_" + name.upper()


def _names(name: str) -> str:
    return f"{flag_name(name)} (config key {name})"


# -- converting raw values -------------------------------------------------------
def _from_text(kind: str, raw: str) -> Setting:
    """A value given as text (flag or environment variable)."""
    if kind == "int":
        try:
            return int(raw.strip())
        except ValueError:
            raise ValueError(f"expected an integer, got {raw!r}") from None
    if kind == "duration":
        return parse_duration(raw)
    if kind == "bool":
        value = raw.strip().lower()
        if value in ("true", "1", "yes", "on"):
            return True
        if value in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"expected true or false, got {raw!r}")
    if kind == "list":
        return tuple(item.strip() for item in raw.replace(";", "\n").splitlines() if item.strip())
    return raw


def _from_toml(kind: str, raw: object) -> Setting:
    """A value as TOML parsed it; strings are not numbers and numbers are not strings."""
    if kind == "int":
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        raise ValueError(f"expected an integer, got {raw!r}")
    if kind == "duration":
        if isinstance(raw, (str, int, float)) and not isinstance(raw, bool):
            return parse_duration(raw)
        raise ValueError(f"expected a duration such as \"30s\" or a number of seconds, got {raw!r}")
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        raise ValueError(f"expected true or false, got {raw!r}")
    if kind == "list":
        if isinstance(raw, list) and all(isinstance(item, str) for item in raw):
            return tuple(raw)
        raise ValueError(f"expected a list of strings, got {raw!r}")
    if isinstance(raw, str):
        return raw
    raise ValueError(f"expected a string, got {raw!r}")


# -- the config file -------------------------------------------------------------
def parse_config(text: str, source: str = "<config>") -> dict[str, Setting]:
    """Field values from TOML text; ``source`` names the file in error messages."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None
    values: dict[str, Setting] = {}
    for key, raw in data.items():
        f = _FIELDS.get(key)
        if f is None:
            raise ConfigError(f"{source}: unknown key {key!r}{_did_you_mean(key)}")
        try:
            values[key] = _from_toml(f.metadata["kind"], raw)
        except ValueError as exc:
            raise ConfigError(f"{source}: {key}: {exc}") from None
    return values


def _did_you_mean(key: str) -> str:
    candidate = key.strip().replace("-", "_").lower()
    if candidate in _FIELDS:
        return f" (did you mean {candidate!r}?)"
    close = difflib.get_close_matches(candidate, list(_FIELDS), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def load_config(path: str | os.PathLike[str]) -> dict[str, Setting]:
    """Field values from the TOML file at ``path``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{path}: cannot read config file: {reason}") from None
    return parse_config(text, str(path))


# -- flags, environment, file, defaults --------------------------------------------
def _default_of(f: dataclasses.Field) -> object:
    if f.default is dataclasses.MISSING:
        raise TypeError(f"option {f.name} has no default")  # every Options field has one
    return f.default


def _default_text(f: dataclasses.Field) -> str:
    default = _default_of(f)
    if f.metadata["kind"] == "duration":
        assert isinstance(default, (int, float))
        return format_duration(default)
    if f.metadata["kind"] == "bool":
        return "true" if default else "false"
    if f.metadata["kind"] == "list":
        assert isinstance(default, (list, tuple))
        return "none" if not default else ", ".join(default)
    return repr(default) if f.metadata["kind"] == "str" else str(default)


_METAVARS = {"int": "N", "duration": "DURATION", "bool": "BOOL", "list": "NAME=DSN"}


def build_parser(prog: str = "dmq-server") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="dmq: a reliable message server (PostgreSQL-durable). "
        "Settings come from flags, then DMQ_* environment variables, then the --config file, "
        "then the defaults shown.",
    )
    parser.add_argument(
        "--config",
        dest="config",
        default=None,
        metavar="PATH",
        help=f"TOML file of settings, keys named like the options below with underscores "
        f"(env {CONFIG_ENV}; example: deploy/dmq.conf.example)",
    )
    for f in dataclasses.fields(Options):
        help_text = f"{f.metadata['help']} (env {env_name(f.name)}; default {_default_text(f)})"
        parser.add_argument(
            flag_name(f.name),
            dest=f.name,
            default=None,
            action="append" if f.metadata["kind"] == "list" else "store",
            metavar=_METAVARS.get(f.metadata["kind"]),
            help=help_text.replace("%", "%%"),
        )
    return parser


def _resolve(
    flags: Mapping[str, str | None], environ: Mapping[str, str], file_values: Mapping[str, Setting]
) -> Options:
    # each value is of its field's kind (``_from_text``, ``_from_toml``), which the type
    # checker cannot pair with the field's name: the values meet their types in Options
    values: dict[str, Any] = dict(file_values)
    for f in dataclasses.fields(Options):
        for raw, source in (
            (flags.get(f.name), flag_name(f.name)),
            (environ.get(env_name(f.name)), env_name(f.name)),
        ):
            if raw is not None:
                if isinstance(raw, list):  # a repeated flag (kind "list")
                    raw = "\n".join(raw)
                try:
                    values[f.name] = _from_text(f.metadata["kind"], raw)
                except ValueError as exc:
                    raise ConfigError(f"{source}: {exc}") from None
                break
    return Options(**values).validate()


def options_from_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> Options:
    """Options from flags, then ``DMQ_*`` variables, then the config file, then defaults."""
    environ = os.environ if environ is None else environ
    args = vars(build_parser().parse_args(argv))
    config = args.pop("config") or environ.get(CONFIG_ENV) or None
    try:
        file_values = load_config(config) if config else {}
        return _resolve(args, environ, file_values)
    except ValueError as exc:
        raise SystemExit(f"dmq-server: {exc}") from None


# -- the example config ---------------------------------------------------------
_EXAMPLE_HEADER = """\
# dmq server configuration (TOML).
#
# Use it with `dmq-server --config PATH` or DMQ_CONFIG=PATH. Every key is optional;
# each one below is commented out and shows its default. Precedence: command-line
# flag > DMQ_* environment variable > this file > default. Durations are strings
# such as "250ms", "30s", "5m", "1h", or numbers of seconds. Relative paths are
# relative to the server's working directory.
#
# Generated from dmq_server/core/options.py; do not edit by hand. Regenerate with
#   python -m dmq_server.core.options --example > deploy/dmq.conf.example
"""


def _toml_value(f: dataclasses.Field) -> str:
    kind, value = f.metadata["kind"], _default_of(f)
    if kind == "int":
        return str(value)
    if kind == "bool":
        return "true" if value else "false"
    if kind == "duration":
        assert isinstance(value, (int, float))
        value = format_duration(value)
    if kind == "list":
        assert isinstance(value, (list, tuple))
        value = list(value)
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string


def render_example() -> str:
    """The commented example config file, one block per field, defaults commented out."""
    blocks = [_EXAMPLE_HEADER]
    for f in dataclasses.fields(Options):
        lines = textwrap.wrap(f.metadata["help"], width=86)
        lines.append(f"flag {flag_name(f.name)}, env {env_name(f.name)}")
        block = "".join(f"# {line}\n" for line in lines)
        blocks.append(f"{block}# {f.name} = {_toml_value(f)}\n")
    return "\n".join(blocks)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dmq_server.core.options --example``: print the example config."""
    parser = argparse.ArgumentParser(
        prog="python -m dmq_server.core.options",
        description="Tools for dmq server settings.",
    )
    parser.add_argument(
        "--example", action="store_true", help="print the commented example config file"
    )
    args = parser.parse_args(argv)
    if not args.example:
        parser.print_usage(sys.stderr)
        return 2
    sys.stdout.write(render_example())
    return 0


if __name__ == "__main__":
    sys.exit(main())

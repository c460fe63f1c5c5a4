"""Every server setting, in one dataclass with documented defaults.

The command-line flags (nsqd's names where the two overlap), the ``DMQ_*``
environment variables and ``deploy/dmq.conf.example`` are all generated from
the fields below, so a setting cannot exist in one place and not the others.
Precedence: flag > environment > default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["Options", "parse_duration", "parse_address", "build_parser", "options_from_args"]


def parse_duration(text: str | float | int) -> float:
    """Seconds from ``"250ms"``, ``"30s"``, ``"5m"``, ``"1h"`` or a bare number of seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    value = text.strip().lower()
    for suffix, scale in (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if value.endswith(suffix):
            number = value[: -len(suffix)]
            break
    else:
        number, scale = value, 1.0
    try:
        seconds = float(number) * scale
    except ValueError:
        raise ValueError(f"invalid duration {text!r} (examples: 250ms, 30s, 5m)") from None
    if seconds < 0:
        raise ValueError(f"duration {text!r} must not be negative")
    return seconds


def parse_address(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (``":PORT"`` means 127.0.0.1) into a host and port."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"invalid address {text!r}, expected HOST:PORT")
    return (host.strip("[]") or "127.0.0.1"), int(port)


def _opt(default: Any, help: str, *, kind: str = "str", flag: str | None = None) -> Any:
    return field(default=default, metadata={"help": help, "kind": kind, "flag": flag})


@dataclass(frozen=True)
class Options:
    """dmq server options. Field names map to ``--flag-name`` and ``DMQ_FIELD_NAME``."""

    data_path: str = _opt("./dmq-data", "directory for the embedded PostgreSQL and local state")
    tcp_address: str = _opt("127.0.0.1:4150", "HOST:PORT for the TCP protocols (dmq, later NSQ)")
    http_address: str = _opt("127.0.0.1:4151", "HOST:PORT for the HTTP API (/ping, /stats)")
    pg_dsn: str = _opt(
        "", "PostgreSQL DSN; empty starts a private PostgreSQL under --data-path"
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
    ack_batch_size: int = _opt(5000, "most acknowledgements made durable in one transaction", kind="int")
    ack_flush_interval: float = _opt(
        0.01, "how long acknowledgements may wait to be batched", kind="duration"
    )
    registry_refresh: float = _opt(
        2.0, "how often topics and channels are re-read from the registry", kind="duration"
    )
    message_retention: float = _opt(
        600.0,
        "how long a fully acknowledged message is kept (resend idempotency window)",
        kind="duration",
    )
    sweep_interval: float = _opt(
        30.0, "how often fully acknowledged messages past retention are removed", kind="duration"
    )
    scan_interval: float = _opt(
        0.1, "how often in-flight deadlines are checked", kind="duration"
    )
    shutdown_timeout: float = _opt(
        30.0, "longest a graceful shutdown waits for batches to commit", kind="duration"
    )
    log_level: str = _opt("info", "debug, info, warn or error")

    # -- derived helpers -------------------------------------------------
    @property
    def tcp_endpoint(self) -> tuple[str, int]:
        return parse_address(self.tcp_address)

    @property
    def http_endpoint(self) -> tuple[str, int]:
        return parse_address(self.http_address)

    @property
    def data_dir(self) -> Path:
        return Path(self.data_path).resolve()

    def replace(self, **changes: Any) -> "Options":
        return dataclasses.replace(self, **changes)

    def validate(self) -> "Options":
        """Fail early, with the option's flag name, on values the server cannot use."""
        parse_address(self.tcp_address)
        parse_address(self.http_address)
        checks = [
            ("max_msg_size", self.max_msg_size >= 1),
            ("msg_timeout", self.msg_timeout > 0),
            ("heartbeat_interval", self.heartbeat_interval > 0),
            ("default_credit", 1 <= self.default_credit <= self.max_credit),
            ("mem_queue_size", self.mem_queue_size >= 1),
            ("commit_batch_size", self.commit_batch_size >= 1),
            ("ack_batch_size", self.ack_batch_size >= 1),
            ("scan_interval", self.scan_interval > 0),
        ]
        for name, ok in checks:
            if not ok:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag}: invalid value {getattr(self, name)!r}")
        return self


def _convert(kind: str, raw: Any) -> Any:
    if kind == "int":
        return int(raw)
    if kind == "duration":
        return parse_duration(raw)
    return str(raw)


def build_parser(prog: str = "dmq-server") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="dmq: a reliable message server (PostgreSQL-durable).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in dataclasses.fields(Options):
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        env = "DMQ_" + f.name.upper()
        parser.add_argument(
            flag,
            dest=f.name,
            default=None,
            help=f"{f.metadata['help']} (env {env}; default {f.default!r})",
        )
    return parser


def options_from_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> Options:
    """Options from flags, then ``DMQ_*`` variables, then defaults."""
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Options):
        raw = getattr(args, f.name)
        if raw is None:
            raw = environ.get("DMQ_" + f.name.upper())
        if raw is not None:
            try:
                values[f.name] = _convert(f.metadata["kind"], raw)
            except ValueError as exc:
                flag = "--" + f.name.replace("_", "-")
                raise SystemExit(f"dmq-server: {flag}: {exc}") from None
    try:
        return Options(**values).validate()
    except ValueError as exc:
        raise SystemExit(f"dmq-server: {exc}") from None

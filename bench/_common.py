"""Shared helpers of the benchmark: ports, percentiles, /proc sampling, tables.

Only the standard library: the figures come from /proc (CPU seconds, RSS) and
from timestamps taken by the load generators themselves.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import threading
import time
from typing import Any, Iterable, Sequence

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- percentiles


def percentiles(values: Iterable[float], points: Sequence[float] = (50, 99, 99.9)) -> dict:
    """Nearest-rank percentiles of ``values`` (seconds) as milliseconds, plus count/mean/max."""
    data = sorted(values)
    out: dict = {"count": len(data)}
    if not data:
        for p in points:
            out[_pname(p)] = None
        out["mean"] = out["max"] = None
        return out
    n = len(data)
    for p in points:
        rank = max(1, math.ceil(p / 100.0 * n))
        out[_pname(p)] = round(data[rank - 1] * 1000.0, 3)
    out["mean"] = round(sum(data) / n * 1000.0, 3)
    out["max"] = round(data[-1] * 1000.0, 3)
    return out


def _pname(p: float) -> str:
    return "p" + (str(p).replace(".", "_") if p != int(p) else str(int(p)))


def fmt_lat(stats: dict) -> str:
    """``p50 / p99 / p99.9`` in ms from a percentiles() dict."""
    if not stats or not stats.get("count"):
        return "n/a (no samples)"
    return f"{stats['p50']:.2f} / {stats['p99']:.2f} / {stats['p99_9']:.2f}"


# ---------------------------------------------------------------- /proc


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    # fields after "(comm)": state ppid pgrp session tty tpgid flags minflt cminflt
    # majflt cmajflt utime stime cutime cstime ...
    return text.rsplit(")", 1)[1].split()


def cpu_seconds(pid: int, with_children: bool = False) -> float:
    """User+system CPU seconds of a process (all its threads); optionally plus reaped children."""
    f = _stat_fields(pid)
    if f is None:
        return 0.0
    ticks = int(f[11]) + int(f[12])
    if with_children:
        ticks += int(f[13]) + int(f[14])
    return ticks / _CLK_TCK


def machine_busy_seconds() -> tuple[float, float, float]:
    """(process time, interrupt time, steal time) in CPU seconds over all cores, from /proc/stat.

    Process time is user+nice+system, the same clock as the per-process figures.
    Interrupt time (irq+softirq) is mostly loopback TCP work caused by the
    benchmark's own traffic; the kernel does not charge it to any process.
    Steal time is when the hypervisor ran something else while this virtual
    machine's processes were ready to run: on a busy host it slows every figure
    (a quarter of the CPU in one session-4 run, none in others).
    """
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return 0.0, 0.0, 0.0
    # cpu user nice system idle iowait irq softirq steal guest guest_nice
    v = [int(x) for x in fields[1:]]
    steal = v[7] / _CLK_TCK if len(v) > 7 else 0.0
    return (v[0] + v[1] + v[2]) / _CLK_TCK, (v[5] + v[6]) / _CLK_TCK, steal


def _all_pids() -> list[int]:
    try:
        return [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []


def tree_cpu_seconds(root: int) -> float:
    """CPU of ``root`` (plus children it reaped) and of its live direct children.

    Right for PostgreSQL: backends are direct children of the postmaster, and a
    backend that exited has its time added to the postmaster's cutime/cstime.
    """
    total = cpu_seconds(root, with_children=True)
    for pid in _all_pids():
        f = _stat_fields(pid)
        if f is not None and pid != root and int(f[1]) == root:
            total += cpu_seconds(pid, with_children=True)
    return total


_PG_BACKGROUND = ("checkpointer", "background writer", "walwriter", "autovacuum", "logical replication",
                  "archiver", "stats collector", "walsender", "walreceiver", "startup")


def pg_background_cpu_seconds(postmaster: int) -> float:
    """CPU of a PostgreSQL's own work besides its client sessions: the postmaster, the
    checkpointer, background and WAL writers, autovacuum (workers that ended are in the
    postmaster's reaped time). The tree's CPU minus that of the live client backends, so
    it is exact while no client session ends between two readings (dmq's connections
    last the whole scenario)."""
    clients = 0.0
    for pid in _all_pids():
        f = _stat_fields(pid)
        if f is None or int(f[1]) != postmaster:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                title = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        role = title.split(":", 1)[1].strip() if title.startswith("postgres:") else ""
        if role and not role.startswith(_PG_BACKGROUND):
            clients += cpu_seconds(pid, with_children=True)
    return max(0.0, tree_cpu_seconds(postmaster) - clients)


def descendants(root: int) -> list[int]:
    """Live processes below ``root`` (children, grandchildren, ...), by parent pid."""
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        f = _stat_fields(pid)
        if f is not None:
            children.setdefault(int(f[1]), []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def family_cpu_seconds(root: int) -> float:
    """CPU of ``root`` and all its live descendants, plus what each of them reaped."""
    return sum(cpu_seconds(pid, with_children=True) for pid in [root, *descendants(root)])


def memory_kb(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in kB; (0, 0) if it is gone."""
    rss = hwm = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1])
    except OSError:
        pass
    return rss, hwm


class Scraper:
    """GETs a URL every ``interval`` seconds on a thread (a Prometheus server scraping
    ``/metrics``), so a run can measure what being scraped costs the server."""

    def __init__(self, url: str, interval: float):
        self.url = url
        self.interval = interval
        self.scrapes = 0
        self.failures = 0
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scraper", daemon=True)

    def start(self) -> "Scraper":
        self._thread.start()
        return self

    def _run(self) -> None:
        import urllib.request

        while not self._stop.wait(self.interval):
            try:
                with urllib.request.urlopen(self.url, timeout=10) as reply:
                    self.bytes += len(reply.read())
                self.scrapes += 1
            except OSError:
                self.failures += 1

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=15)
        return {"interval": self.interval, "scrapes": self.scrapes, "failures": self.failures, "bytes": self.bytes}


class RssSampler:
    """Samples a process's VmRSS/VmHWM every ``interval`` seconds on a thread."""

    def __init__(self, pid: int, interval: float = 0.1):
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[float, int, int]] = []  # (time.time(), rss_kb, hwm_kb)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> "RssSampler":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, hwm = memory_kb(self.pid)
            if rss:
                self.samples.append((time.time(), rss, hwm))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def window(self, start: float, end: float) -> dict:
        """Max RSS and last HWM (MB) of samples between two time.time() stamps."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if not inside:
            return {"max_rss_mb": None, "hwm_mb": None, "samples": 0}
        return {
            "max_rss_mb": round(max(s[1] for s in inside) / 1024.0, 1),
            "hwm_mb": round(max(s[2] for s in inside) / 1024.0, 1),
            "samples": len(inside),
        }


# ---------------------------------------------------------------- machine


class StartedServer:
    """A server process the benchmark started (``self.proc``, a Popen): its pid and CPU seconds."""

    proc: Any = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def cpu(self) -> float:
        return cpu_seconds(self.pid) if self.proc is not None else 0.0


def stop_process(proc: Any, timeout: float = 30) -> None:
    """SIGTERM a server we started (Popen), SIGKILL it if it is still there after ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def log_tail(path: Any, lines: int = 30) -> str:
    """The last lines of a started peer's log, for an error message."""
    try:
        with open(path, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def apt_get_install(package: str, log: Any = print) -> None:
    """Install a Debian package a peer of the benchmark needs (first run only; root).

    ``deploy/setup.sh --bench`` installs the same packages; this covers a run
    without it."""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RuntimeError(f"{package} is not installed and apt-get (as root) is not available; "
                           "run bash deploy/setup.sh --bench")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "-o", "DPkg::Lock::Timeout=600", "install", "-y", "--no-install-recommends", package]
    log(f"  installing {package} with apt-get (first run only) ...")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        log("  apt-get install failed; running apt-get update once and retrying ...")
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"apt-get install {package} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")



def reference_loop_ns(rounds: int = 5, iterations: int = 20_000) -> float:
    """The machine's speed as a fixed pure-Python workload: ns per iteration of a loop of
    the kinds of work dmq-server's hot path does (a dict, a small object, struct, a bytes
    join), the fastest of ``rounds``. The same code on every run and every tree, so two
    runs' figures say how fast the machine was, not what changed in dmq: on this shared
    VM the same build's CPU per message differs by half between days (session 19)."""
    import struct

    pack = struct.Struct(">IHqq").pack

    class Item:
        __slots__ = ("key", "value")

        def __init__(self, key: int, value: bytes) -> None:
            self.key, self.value = key, value

    body = b"x" * 200
    best = float("inf")
    for _ in range(rounds):
        table: dict[int, Item] = {}
        out: list[bytes] = []
        start = time.process_time()
        for i in range(iterations):
            item = Item(i, body)
            table[i & 1023] = item
            out.append(pack(i & 0xFFFF, 1, i, item.key) + item.value)
            if len(out) == 64:
                b"".join(out)
                out.clear()
        best = min(best, time.process_time() - start)
    return best / iterations * 1e9


def machine_info() -> dict:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_kb = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_kb = int(line.split()[1])
                    break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "mem_total_gb": round(mem_kb / 1024 / 1024, 1),
        "kernel": os.uname().release,
        "writeback": kernel_writeback(),
    }


def kernel_writeback() -> dict:
    """The kernel's dirty page cache limits: how much PostgreSQL's unsynced writes pile up
    before the kernel writes them back, which decides the commit stalls of the steady
    scenario (docs/operations.md, "The kernel's writeback")."""
    out = {}
    for name in ("dirty_background_bytes", "dirty_background_ratio", "dirty_expire_centisecs"):
        try:
            with open(f"/proc/sys/vm/{name}") as f:
                out[name] = int(f.read())
        except (OSError, ValueError):
            pass
    return out


def writeback_text(w: dict) -> str:
    """``kernel_writeback()`` in words, for the reports."""
    if not w:
        return "unknown"
    start = (f"{w['dirty_background_bytes'] / 2**20:g} MB" if w.get("dirty_background_bytes")
             else f"{w.get('dirty_background_ratio')} % of memory")
    return f"starts at {start} dirty, after {w.get('dirty_expire_centisecs', 0) / 100:g} s at the latest"


# ---------------------------------------------------------------- output


def fmt_int(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def print_table(title: str, rows: Sequence[tuple[str, str]]) -> None:
    """A titled two-column block: figure label, value."""
    width = max((len(label) for label, _ in rows), default=10)
    print()
    print(f"== {title} ==")
    for label, value in rows:
        print(f"  {label.ljust(width)}  {value}")
    print(flush=True)


def print_grid(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [len(h) for h in header]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    print()
    print(f"== {title} ==")
    line = "  " + "  ".join(h.ljust(w) for h, w in zip(header, widths))
    print(line)
    print("  " + "  ".join("-" * w for w in widths))
    for row in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)))
    print(flush=True)


def run_worker(role: str, body: Any, cfg: dict, index: int, ready_q: Any, start_evt: Any, result_q: Any) -> None:
    """A load-generator process: ``body(cfg, index, ready_q, start_evt, result)`` fills
    ``result``; an error is reported on ``ready_q`` (so the parent stops waiting for
    this worker to connect) and in the result; the process's CPU seconds are added."""
    result: dict = {"index": index, "role": role, "error": None}
    try:
        body(cfg, index, ready_q, start_evt, result)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        result["error"] = f"{type(exc).__name__}: {exc}"
        try:
            ready_q.put(("failed", index, result["error"]))
        except Exception:  # noqa: BLE001 - the parent may be gone
            pass
    result["cpu_s"] = time.process_time()
    result_q.put(result)


def interruptible(run: Any) -> int:
    """``run()``'s exit status, with SIGTERM turned into KeyboardInterrupt, so that a
    benchmark stopped either way leaves through its ``finally`` blocks and stops what it
    started (130 then, as a shell reports Ctrl-C)."""
    import signal

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        return run()
    except KeyboardInterrupt:
        print("\ninterrupted; everything started has been stopped")
        return 130


def wait_for_idle(limit: float, name: str) -> None:
    """On a shared machine, return once less than 0.15 of a core is busy over 2 s, or after
    ``limit`` seconds (0: at once), saying which: a benchmark beside another job measures both."""
    if not limit:
        return
    t0 = time.monotonic()
    while True:
        before = machine_busy_seconds()[0]
        time.sleep(2.0)
        busy = (machine_busy_seconds()[0] - before) / 2.0  # cores busy
        if busy < 0.15:
            waited = time.monotonic() - t0
            if waited > 3:
                print(f"  (waited {waited:.0f} s for the machine to be idle before {name})", flush=True)
            return
        if time.monotonic() - t0 > limit:
            print(f"  (machine still busy ({100 * busy:.0f}% of a core) after {limit:g} s; running {name} anyway)",
                  flush=True)
            return

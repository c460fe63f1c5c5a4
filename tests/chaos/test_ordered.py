"""Per-key order under faults (issue 45 §2): on an ordered topic with 1,000 keys, three
producers and two channels, a consumer killed, two paused and the dmq server killed -9
and restarted; per channel and key, 0 lost, first deliveries in commit order, never two
messages of a key out at once (``tests/chaos/ordered.py`` says how it counts, and which of
the issue's faults are left out and why).

One dmq node on the session's embedded PostgreSQL (docs/protocol.md §5 promises the order
for a key's messages sent through one node), no Patroni, no ZooKeeper: about 30 s. Played
twice: with the default memory window, and with one of 48 copies, where a key with 3
copies waiting is read apart (its copies wait in PostgreSQL and are read with their key):
the run checks that keys were read apart while the faults hit. Run
alone: ``.venv/bin/python -m pytest tests/chaos -k ordered``. A failure's report, the
histories of its keys and the node's log go to ``chaos-failures/`` (``DMQ_CHAOS_FAILURES``
names another folder), as the other scenarios' do.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from pathlib import Path

import pytest

from tests.integration.support import ServerProcess, http_get

from . import conftest, ordered
from .test_scenarios import FAILURES

TIMING = ordered.OrderedTiming()


def _ordered_topic(dsn: str, name: str) -> None:
    import registry
    from dmq_server.db.worker import connect

    with connect(dsn, autocommit=True) as conn:
        registry.create_topic(conn, name, msg_timeout_ms=ordered.MSG_TIMEOUT_MS, ordered=True)
        for channel in ordered.CHANNELS:
            registry.add_channel(conn, name, channel)


class ApartSampler(threading.Thread):
    """The most keys any channel of ``topic`` had read apart at once (``keys_read_apart`` of
    the server's ``/stats``, every 0.2 s; a server being restarted is skipped)."""

    def __init__(self, server: ServerProcess, topic: str):
        super().__init__(daemon=True)
        self.server, self.topic = server, topic
        self.most = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.2):
            try:
                status, body = http_get(self.server.http + "/stats", timeout=2)
                stats = json.loads(body) if status == 200 else {}
            except (OSError, ValueError):
                continue
            for topic in stats.get("topics", []):
                if topic.get("topic_name") == self.topic:
                    for channel in topic.get("channels", []):
                        self.most = max(self.most, int(channel.get("keys_read_apart") or 0))


@pytest.mark.parametrize("window", [None, "48"], ids=["window-default", "window-48"])
def test_per_key_order_holds_under_consumer_kill_pause_and_server_kill(pg_dsn, scratch_dir, window):
    topic = f"chaos_ordered_{window or 'default'}"
    _ordered_topic(pg_dsn, topic)
    flags = {"mem_queue_size": window} if window else {}
    server = ServerProcess(pg_dsn, scratch_dir, node_id="ordered1", log_level="info", **flags)
    server.start(timeout=60)
    text = ""
    out = None
    apart = ApartSampler(server, topic)
    try:
        apart.start()
        out = ordered.run(server, pg_dsn, topic, TIMING)
        apart.stopping.set()
        apart.join(timeout=5)
        orders, counts = ordered.count(out)
        text = ordered.format_report(out, orders, counts)
        conftest.REPORTS.append(text)
        print(text)
        assert out.drained and not out.failures, text
        sent = sum(len(v) for v in out.sends.values())
        assert sent > 2000 and len(out.sends) > 900, text  # the load ran, over (nearly) every key
        # the faults happened where they matter: copies were out at each
        assert out.notes["held_at_consumer_kill"] > 0 and out.notes["held_at_pause"] > 1, text
        assert all(n > 0 for n in out.notes["out_at_server_kill"].values()), text
        # the killed consumer held a copy with a later message of its key stored: it came back first
        assert orders["billing"].redelivered_ahead > 0, text
        for channel in ordered.CHANNELS:
            o = orders[channel]
            assert o.sent == sent, text
            assert o.lost == 0, text
            assert o.order_violations == [], text
            assert o.overlaps == [], text
            assert o.same_id_overlaps == [], text
            assert o.passed == [], text
            assert o.redelivered > 0, text  # copies came back (consumer killed, server killed)
            assert o.waited > 100, text  # the rule held messages back behind their key
        for c in counts:
            assert c.lost == 0 and c.duplicated == 0 and c.unexpected == 0, text
        assert ordered.ok(out, orders, counts), text
        if window:  # the faults met keys read apart
            assert apart.most > 0, f"no key was read apart with a window of {window}\n{text}"
        print(f"keys read apart at once, at most: {apart.most}")
    except BaseException:
        kept = _keep_failure(server, out, text)
        print(f"the whole failure is kept in {kept}")
        raise
    finally:
        apart.stopping.set()
        server.stop()


def _keep_failure(server: ServerProcess, out: ordered.OrderedRun | None, text: str) -> Path:
    """The report, the whole history of every key that broke a rule (at most 20 a channel)
    and the node's log, in a file of its own."""
    FAILURES.mkdir(parents=True, exist_ok=True)
    path = FAILURES / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-ordered.txt"
    parts = [f"chaos scenario ordered failed at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
             traceback.format_exc(), text]
    if out is not None:
        orders = ordered.check_order(out.sends, out.attempts, out.kills, ordered.CHANNELS, out.origin)
        for channel, o in orders.items():
            parts.append(f"=== {channel}: every problem found\n" + "\n".join(o.problems()))
            for key in o.bad_keys[:20]:
                lines = ordered.key_history(out.sends, out.attempts, out.kills, channel, key, out.origin)
                parts.append(f"=== {channel} {key} (seconds from the run's start)\n" + "\n".join(lines))
    try:
        log = server.log_path.read_text(errors="replace")[-400_000:]
    except OSError as exc:
        log = f"(unreadable: {exc})"
    parts.append(f"=== log of the dmq node (its last 400,000 characters)\n{log}")
    path.write_text("\n\n".join(parts))
    return path

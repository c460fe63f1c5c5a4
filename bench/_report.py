"""Markdown rendering of a run's results (``reliable.py --markdown PATH``), for docs/benchmarks.md."""

from __future__ import annotations

from typing import Any

from _common import writeback_text


def _n(value: Any) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def _lat(stats: dict | None) -> str:
    if not stats or not stats.get("count"):
        return "n/a"
    return f"{stats['p50']:.1f} / {stats['p99']:.1f} / {stats['p99_9']:.1f}"


def _cpu(cpu: dict | None, wall: float | None) -> str:
    if not cpu or not wall:
        return "n/a"
    return ", ".join(f"{k} {v:.1f} s ({100 * v / wall:.0f}%)" for k, v in cpu.items())


def _us(d: dict | None) -> str:
    if not d:
        return "n/a"
    return " / ".join(f"{k} {v:.0f}" for k, v in d.items())


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def render(results: dict) -> str:
    meta = results.get("meta", {})
    m = meta.get("machine", {})
    parts = [
        f"Run of {meta.get('date_utc', '?')} UTC: `{meta.get('command', '?')}`  ",
        f"Machine: {m.get('nproc')} cores ({m.get('cpu_model')}), {m.get('mem_total_gb')} GB RAM, "
        f"Linux {m.get('kernel')}, Python {meta.get('python')}, PostgreSQL {meta.get('postgresql', '?')}, "
        f"RabbitMQ {results.get('rabbit', {}).get('version', '?')}, "
        f"nats-server {results.get('nats', {}).get('version', '?')}. Kernel writeback: "
        f"{writeback_text(m.get('writeback') or {})}.",
        "",
        *([f"Background load: processes outside the benchmark used on average "
           f"{results['background_other_processes_pct_of_core']:.0f}% of one core (of {100 * (m.get('nproc') or 1)}%) "
           "during the load scenarios.", ""] if results.get("background_other_processes_pct_of_core") is not None
          else []),
        *([f"Steal: the hypervisor took on average {results['stolen_by_hypervisor_pct']:.0f}% of the virtual "
           "machine's CPU during the dmq load scenarios.", ""] if results.get("stolen_by_hypervisor_pct") is not None
          else []),
        "### Summary",
        "",
        _table(
            ["figure", "measured", "target", "verdict"],
            [[r["figure"], r["measured"], r["target"], r["verdict"]] for r in results.get("summary", [])],
        ),
        "",
        "### Detail",
        "",
    ]
    rows: list[list[str]] = []
    p = results.get("publish") or {}
    if "acked_msgs_s" in p:
        rows.append(["dmq publish", f"{_n(p['acked_msgs_s'])} acked msgs/s", "publish→ack " + _lat(p["publish_ack_latency_ms"]),
                     _us(p.get("cpu_us_per_message")), _cpu(p.get("cpu_s"), p.get("elapsed_s"))])
    mp = results.get("mpub") or {}
    if "acked_msgs_s" in mp:
        rows.append([f"dmq NSQ MPUB of {mp['batch']}, reliable topic", f"{_n(mp['acked_msgs_s'])} acked msgs/s",
                     "MPUB→OK " + _lat(mp["mpub_ok_latency_ms"]), _us(mp.get("cpu_us_per_message")),
                     _cpu(mp.get("cpu_s"), mp.get("elapsed_s"))])
    for key in ("e2e1", "e2e4"):
        e = results.get(key) or {}
        if "total_msgs_s" in e:
            per = ", ".join(_n(c["msgs_s"]) for c in e["per_channel"])
            rows.append([
                f"dmq end to end, {e['channels']} channel{'s' if e['channels'] > 1 else ''}",
                f"{_n(e['total_msgs_s'])} delivered+acked msgs/s total (per channel: {per}); "
                f"published {_n(e['publish_msgs_s'])} msgs/s",
                "publish→delivery " + _lat(e["publish_delivery_latency_ms"]),
                _us(e.get("cpu_us_per_message")),
                _cpu(e.get("cpu_s"), e.get("elapsed_s")),
            ])
    s = results.get("steady") or {}
    if "achieved_msgs_s" in s:
        rows.append([
            f"dmq steady load, {_n(s['offered_rate'])} msgs/s offered",
            f"{_n(s['achieved_msgs_s'])} acked msgs/s",
            "publish→ack " + _lat(s["publish_ack_latency_ms"]),
            _us(s.get("cpu_us_per_message")),
            _cpu(s.get("cpu_s"), s.get("seconds")),
        ])
    r = results.get("rabbit") or {}
    rp = r.get("publish") or {}
    if "confirmed_msgs_s" in rp:
        rows.append(["RabbitMQ publish", f"{_n(rp['confirmed_msgs_s'])} confirmed msgs/s",
                     "publish→confirm " + _lat(rp["publish_confirm_latency_ms"]),
                     _us(rp.get("cpu_us_per_message")), _cpu(rp.get("cpu_s"), rp.get("elapsed_s"))])
    re = r.get("e2e") or {}
    if "msgs_s" in re:
        rows.append(["RabbitMQ end to end, 1 consumer",
                     f"{_n(re['msgs_s'])} delivered+acked msgs/s; published {_n(re['publish_msgs_s'])} msgs/s",
                     "publish→delivery " + _lat(re["publish_delivery_latency_ms"]),
                     _us(re.get("cpu_us_per_message")), _cpu(re.get("cpu_s"), re.get("elapsed_s"))])
    nats = results.get("nats") or {}
    for mode, label in (("default", "acked from memory, fsync every 2 min"),
                        ("sync_always", "sync_interval: always")):
        node = nats.get(mode) or {}
        if "error" in node:
            said = f" (it says: {node['server_said']})" if node.get("server_said") else ""
            rows.append([f"NATS JetStream ({label})", node["error"] + said, "-", "-", "-"])
        np_, ne = node.get("publish") or {}, node.get("e2e") or {}
        if "confirmed_msgs_s" in np_:
            rows.append([f"NATS JetStream publish ({label})", f"{_n(np_['confirmed_msgs_s'])} PubAcked msgs/s",
                         "publish→PubAck " + _lat(np_["publish_confirm_latency_ms"]),
                         _us(np_.get("cpu_us_per_message")), _cpu(np_.get("cpu_s"), np_.get("elapsed_s"))])
        if "msgs_s" in ne:
            rows.append([f"NATS JetStream end to end, 1 consumer ({label})",
                         f"{_n(ne['msgs_s'])} delivered+acked msgs/s; published {_n(ne['publish_msgs_s'])} msgs/s",
                         "publish→delivery " + _lat(ne["publish_delivery_latency_ms"]),
                         _us(ne.get("cpu_us_per_message")), _cpu(ne.get("cpu_s"), ne.get("elapsed_s"))])
    parts.append(_table(["scenario", "throughput", "latency p50 / p99 / p99.9 (ms)",
                         "CPU µs per message (server / PostgreSQL / its background part)",
                         "CPU seconds (% of one core) during the scenario"], rows))
    c = results.get("ceiling") or {}
    if c.get("runs"):
        parts += ["", "PostgreSQL alone (`insert_messages`, one connection, `synchronous_commit=on`, commit per batch, "
                  "1 channel: each message is one message row, covered by the channel's cursor):", ""]
        parts.append(_table(
            ["batch", "messages/s", "rows/s", "commits/s", "backend CPU per message",
             "all PostgreSQL processes (incl. autovacuum)"],
            [[str(x["batch"]), _n(x["msgs_s"]), _n(x["rows_s"]), _n(x["commits_s"]),
              f"{x.get('backend_us_per_message', 0):.0f} µs",
              f"{x['postgres_cpu_s']:.1f} s in {x['seconds']:.1f} s"] for x in c["runs"]],
        ))
    b = results.get("backlog") or {}
    if "max_rss_mb" in b:
        parts += ["", f"Backlog memory, {_n(b['stored_unacked'])} stored unacknowledged messages on one channel:", ""]
        parts.append(_table(
            ["phase", "messages", "dmq-server RSS (MB)"],
            [
                ["started, no consumer (2 s)", "-", str(b["idle_rss_mb"])],
                [f"subscribed, credit {meta.get('settings', {}).get('credit', '?')}, no acks "
                 f"({b['noack_phase']['seconds']:g} s)", f"{_n(b['noack_phase']['received'])} received",
                 f"max {b['noack_phase']['max_rss_mb']}"],
                [f"subscribed and acking ({b['ack_phase']['seconds']:g} s)",
                 f"{_n(b['ack_phase']['acked'])} acked ({_n(b['ack_phase']['drain_msgs_s'])} msgs/s)",
                 f"max {b['ack_phase']['max_rss_mb']}"],
                ["whole scenario", "-", f"max {b['max_rss_mb']}, VmHWM {b['vm_hwm_mb']}"],
            ],
        ))
    errors = results.get("errors") or {}
    if errors:
        parts += ["", "Failed scenarios: " + "; ".join(f"{k}: {v}" for k, v in errors.items())]
    return "\n".join(parts) + "\n"

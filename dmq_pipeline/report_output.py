"""Writing a report: Parquet and CSV tables, PNG charts and one HTML page.

Layout under ``--out``::

    report.html                  open this
    charts/<chart>.png
    tables/<table>.csv           one file per table, header row, UTC ISO times
    tables/<table>.parquet/      the same table as Parquet (one part file)

The tables are aggregates, collected on the driver, and the driver writes every
file itself (the Parquet with pyarrow): ``--out`` is a directory on the machine
that runs ``dmq-pipeline``, whatever the master. (Written by Spark, the Parquet went
to the executors' own disks on a cluster, leaving only ``_SUCCESS`` here.) What was
written is read back and counted before the report says it is done.
"""

from __future__ import annotations

import csv
import html
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path

from . import charts
from .errors import JobFailed

__all__ = ["write_all"]

#: Column names and types of every table, in output order.
SCHEMAS = {
    "summary": (
        ("topic", "string"), ("channel", "string"), ("delivered", "long"), ("p50_ms", "double"),
        ("p95_ms", "double"), ("p99_ms", "double"), ("mean_attempts", "double"),
        ("redelivered", "long"), ("backlog_at_end", "long"), ("max_backlog", "long"),
        ("dead_letters", "long"),
    ),
    "throughput": (("topic", "string"), ("channel", "string"), ("minute", "timestamp"), ("acked", "long")),
    "latency": (
        ("topic", "string"), ("channel", "string"), ("delivered", "long"), ("p50_ms", "double"),
        ("p95_ms", "double"), ("p99_ms", "double"), ("mean_ms", "double"), ("max_ms", "double"),
    ),
    "attempts": (("topic", "string"), ("channel", "string"), ("attempts", "int"), ("deliveries", "long")),
    "backlog": (
        ("topic", "string"), ("channel", "string"), ("backlog_at_end", "long"), ("max_backlog", "long"),
        ("pending_now", "long"), ("oldest_pending_published_at", "timestamp"),
    ),
    "backlog_series": (("topic", "string"), ("channel", "string"), ("minute", "timestamp"), ("backlog", "long")),
    "dead_letters": (
        ("topic", "string"), ("channel", "string"), ("reason", "string"), ("dead_letters", "long"),
        ("replayed", "long"),
    ),
}


def _write_parquet(path: Path, name: str, data: list[tuple]) -> None:
    """One table as ``<path>/part-00000.parquet``, in the types Spark would give it
    (times as UTC-adjusted microseconds, which Spark reads as timestamps)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kinds = {"string": pa.string(), "long": pa.int64(), "int": pa.int32(), "double": pa.float64(),
             "timestamp": pa.timestamp("us", tz="UTC")}
    schema = pa.schema([(col, kinds[kind]) for col, kind in SCHEMAS[name]])
    columns = list(zip(*data)) if data else [() for _ in SCHEMAS[name]]
    table = pa.Table.from_arrays(
        [pa.array(list(values), type=f.type) for values, f in zip(columns, schema)], schema=schema
    )
    path.mkdir(parents=True)
    pq.write_table(table, path / "part-00000.parquet")


def _check(out: Path, tables: dict[str, list[dict]]) -> None:
    """Every table's CSV and Parquet hold its rows, and the page is there."""
    import pyarrow.parquet as pq

    for name, rows in tables.items():
        with open(out / "tables" / f"{name}.csv", newline="", encoding="utf-8") as fh:
            in_csv = sum(1 for _ in csv.reader(fh)) - 1
        in_parquet = sum(pq.read_metadata(p).num_rows for p in (out / "tables" / f"{name}.parquet").glob("*.parquet"))
        if in_csv != len(rows) or in_parquet != len(rows):
            raise JobFailed(
                f"report: {out}/tables/{name} holds {in_csv} rows as CSV and {in_parquet} as Parquet, "
                f"not {len(rows)}: is {out} a directory this machine can write?"
            )
    if not (out / "report.html").is_file():
        raise JobFailed(f"report: {out}/report.html was not written")


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def write_all(result) -> list[str]:
    """Write every output and check it; returns the paths written, relative to ``--out``."""
    out = Path(os.path.abspath(result.out))
    tables_dir = out / "tables"
    if tables_dir.exists():
        shutil.rmtree(tables_dir)  # a report replaces the previous one in the same place
    tables_dir.mkdir(parents=True)
    files = []
    for name, rows in result.tables.items():
        columns = [col for col, _ in SCHEMAS[name]]
        data = [tuple(row.get(c) for c in columns) for row in rows]
        _write_parquet(tables_dir / f"{name}.parquet", name, data)
        with open(tables_dir / f"{name}.csv", "w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            writer.writerow(columns)
            writer.writerows([_cell(v) for v in row] for row in data)
        files += [f"tables/{name}.csv", f"tables/{name}.parquet"]
    chart_dir = out / "charts"
    if chart_dir.exists():
        shutil.rmtree(chart_dir)
    end = min(result.range.until, datetime.now(timezone.utc))
    drawn = charts.draw_all(result.tables, chart_dir, end)
    files += [f"charts/{png}" for png in drawn.values()]
    (out / "report.html").write_text(render_html(result, drawn), encoding="utf-8")
    files.append("report.html")
    _check(out, result.tables)
    return files


# -- HTML ---------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:1100px;
color:#1d2733;padding:0 1rem}
h1{margin-bottom:.2rem}.sub{color:#5b6775;margin-top:0}
.cards{display:flex;gap:1rem;flex-wrap:wrap;margin:1.5rem 0}
.card{flex:1;min-width:150px;border:1px solid #d8dee6;border-radius:8px;padding:.8rem 1rem}
.card .v{font-size:1.7rem;font-weight:600}.card .k{color:#5b6775;font-size:.85rem}
table{border-collapse:collapse;width:100%;font-size:.9rem;margin:.5rem 0 1.5rem}
th,td{padding:.35rem .6rem;border-bottom:1px solid #e6eaef;text-align:right}
th{background:#f4f6f9}td:first-child,td:nth-child(2),th:first-child,th:nth-child(2){text-align:left}
img{max-width:100%;border:1px solid #e6eaef;border-radius:6px}
.note{color:#5b6775;font-size:.85rem}
"""


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return html.escape(str(value))


def _card(label: str, value: str) -> str:
    return f'<div class="card"><div class="v">{value}</div><div class="k">{html.escape(label)}</div></div>'


def render_html(result, drawn: dict[str, str]) -> str:
    summary = result.tables["summary"]
    delivered = sum(r["delivered"] or 0 for r in summary)
    dead = sum(r["dead_letters"] or 0 for r in summary)
    backlog = sum(r["backlog_at_end"] or 0 for r in summary)
    worst = max((r for r in summary if r["p99_ms"] is not None), key=lambda r: r["p99_ms"], default=None)
    minutes = max((result.range.until - result.range.since).total_seconds() / 60, 1e-9)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>dmq delivery report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>dmq delivery report</h1>",
        f"<p class='sub'>{html.escape(result.range.since.isoformat())} → "
        f"{html.escape(result.range.until.isoformat())} (UTC) · history from "
        f"{html.escape(result.source)}</p>",
        "<div class='cards'>",
        _card("deliveries acknowledged", _fmt(delivered)),
        _card("per minute, on average", _fmt(delivered / minutes)),
        _card(
            f"worst p99 latency ({worst['topic']} / {worst['channel']})" if worst else "p99 latency",
            _fmt(worst["p99_ms"]) + " ms" if worst else "–",
        ),
        _card("waiting at the end of the range", _fmt(backlog)),
        _card("dead letters", _fmt(dead)),
        "</div>",
        "<h2>Per topic and channel</h2>",
        "<table><tr><th>topic</th><th>channel</th><th>delivered</th><th>p50 ms</th><th>p95 ms</th>"
        "<th>p99 ms</th><th>mean attempts</th><th>redelivered</th><th>backlog at end</th>"
        "<th>max backlog</th><th>dead letters</th></tr>",
    ]
    for r in summary:
        parts.append(
            "<tr>" + "".join(
                f"<td>{_fmt(v, 2 if k == 'mean_attempts' else 1)}</td>"
                for k, v in (
                    ("topic", r["topic"]), ("channel", r["channel"] or "(no channel)"),
                    ("delivered", r["delivered"]), ("p50", r["p50_ms"]), ("p95", r["p95_ms"]),
                    ("p99", r["p99_ms"]), ("mean_attempts", r["mean_attempts"]),
                    ("redelivered", r["redelivered"]), ("backlog", r["backlog_at_end"]),
                    ("max_backlog", r["max_backlog"]), ("dead", r["dead_letters"]),
                )
            ) + "</tr>"
        )
    if not summary:
        parts.append("<tr><td colspan='11'>No deliveries, backlog or dead letters in this range.</td></tr>")
    parts.append("</table>")
    captions = {
        "throughput": ("Throughput", "Deliveries acknowledged in each minute."),
        "latency": ("Latency", "Time from the server storing a message to the channel acknowledging it."),
        "backlog": ("Backlog", "Copies published and not yet acknowledged, at each minute with a change."),
        "attempts": ("Attempts", "How many pushes a delivery took; more than 1 means redelivery."),
        "dead_letters": ("Dead letters", "Messages given up on, by reason."),
    }
    for name, (title, text) in captions.items():
        parts.append(f"<h2>{title}</h2><p class='note'>{html.escape(text)}</p>")
        if name in drawn:
            parts.append(f"<img src='charts/{html.escape(drawn[name])}' alt='{html.escape(title)} chart'>")
        else:
            parts.append("<p class='note'>Nothing in this range.</p>")
    links = " · ".join(
        f"<a href='tables/{n}.csv'>{n}.csv</a>" for n in result.tables
    )
    parts.append(f"<h2>Tables</h2><p class='note'>{links} (Parquet next to each CSV).</p>")
    parts.append("</body></html>")
    return "\n".join(parts)

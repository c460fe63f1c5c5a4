"""The report's charts, drawn with matplotlib (no display needed) into PNG files.

Each function takes a collected report table (a list of row dicts), draws one
chart and returns the file name, or None when the table has nothing to draw.
Charts show the busiest series (``MAX_SERIES``); the tables hold all of them.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from pathlib import Path

__all__ = ["draw_all", "MAX_SERIES"]

MAX_SERIES = 8
_SIZE = (9.0, 4.2)
_DPI = 110


def _figure():
    from matplotlib.figure import Figure

    fig = Figure(figsize=_SIZE, dpi=_DPI, layout="constrained")
    return fig, fig.subplots()


def _label(row: dict) -> str:
    return f"{row['topic']} / {row['channel'] or '(no channel)'}"


def _busiest(rows: list[dict], weight: str) -> list[str]:
    totals: dict[str, float] = defaultdict(float)
    for r in rows:
        totals[_label(r)] += r[weight] or 0
    return sorted(totals, key=lambda k: (-totals[k], k))[:MAX_SERIES]


def _save(fig, folder: Path, name: str) -> str:
    fig.savefig(folder / name)
    return name


def throughput(rows: list[dict], folder: Path) -> str | None:
    if not rows:
        return None
    fig, ax = _figure()
    for label in _busiest(rows, "acked"):
        points = sorted((r["minute"], r["acked"]) for r in rows if _label(r) == label)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 60 else None,
                label=label)
    ax.set_title("Acknowledged deliveries per minute")
    ax.set_ylabel("deliveries / minute")
    ax.set_xlabel("minute (UTC)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left")
    fig.autofmt_xdate()
    return _save(fig, folder, "throughput.png")


def latency(rows: list[dict], folder: Path) -> str | None:
    rows = [r for r in rows if r["delivered"]]
    if not rows:
        return None
    rows = sorted(rows, key=lambda r: -r["delivered"])[:MAX_SERIES]
    fig, ax = _figure()
    labels = [_label(r) for r in rows]
    height = 0.26
    for i, (key, name) in enumerate((("p50_ms", "p50"), ("p95_ms", "p95"), ("p99_ms", "p99"))):
        ys = [n + (i - 1) * height for n in range(len(rows))]
        bars = ax.barh(ys, [r[key] for r in rows], height=height, label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize="x-small", padding=2)
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("publish → acknowledge latency (ms)")
    ax.set_title("Latency percentiles")
    if max(r["p99_ms"] for r in rows) > 50 * max(min(r["p50_ms"] for r in rows), 0.001):
        ax.set_xscale("log")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")
    return _save(fig, folder, "latency.png")


def attempts(rows: list[dict], folder: Path) -> str | None:
    if not rows:
        return None
    series = _busiest(rows, "deliveries")[:6]
    values = sorted({r["attempts"] for r in rows})
    fig, ax = _figure()
    width = 0.8 / len(series)
    for i, label in enumerate(series):
        counts = {r["attempts"]: r["deliveries"] for r in rows if _label(r) == label}
        xs = [n + (i - (len(series) - 1) / 2) * width for n in range(len(values))]
        ax.bar(xs, [counts.get(v, 0) for v in values], width=width, label=label)
    ax.set_xticks(range(len(values)), [str(v) for v in values])
    ax.set_xlabel("attempts until acknowledged")
    ax.set_ylabel("deliveries")
    counts = [r["deliveries"] for r in rows if r["deliveries"]]
    if counts and max(counts) > 50 * min(counts):
        # redeliveries are usually rare: a log scale keeps them visible next to attempt 1
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        ax.set_ylim(bottom=0.8)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    else:
        ax.set_ylim(bottom=0)
    ax.set_title("Attempts per delivery (1 = first push acknowledged)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, folder, "attempts.png")


def backlog(rows: list[dict], folder: Path, end: datetime | None = None) -> str | None:
    if not rows:
        return None
    fig, ax = _figure()
    for label in _busiest(rows, "backlog"):
        points = sorted((r["minute"], r["backlog"]) for r in rows if _label(r) == label)
        if end is not None and points[-1][0] < end:
            points.append((end, points[-1][1]))  # the last level holds to the end of the range
        ax.step([p[0] for p in points], [p[1] for p in points], where="post", label=label)
    ax.set_title("Backlog: published, not yet acknowledged")
    ax.set_ylabel("copies waiting")
    ax.set_xlabel("minute (UTC)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left")
    fig.autofmt_xdate()
    return _save(fig, folder, "backlog.png")


def dead_letters(rows: list[dict], folder: Path) -> str | None:
    if not rows:
        return None
    labels = _busiest(rows, "dead_letters")
    reasons = sorted({r["reason"] for r in rows})
    fig, ax = _figure()
    left = [0] * len(labels)
    for reason in reasons:
        counts = [sum(r["dead_letters"] for r in rows if _label(r) == lb and r["reason"] == reason)
                  for lb in labels]
        ax.barh(labels, counts, left=left, label=reason)
        left = [a + b for a, b in zip(left, counts)]
    ax.invert_yaxis()
    ax.set_xlabel("dead letters")
    ax.set_title("Dead letters by reason")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")
    return _save(fig, folder, "dead_letters.png")


def draw_all(tables: dict[str, list[dict]], folder: Path, end: datetime | None = None) -> dict[str, str]:
    """``{table name: png file name}`` for every chart with data; ``end``: where the
    time axes stop (the end of the range, or now if that is earlier)."""
    folder.mkdir(parents=True, exist_ok=True)
    drawn = {
        "throughput": throughput(tables.get("throughput", []), folder),
        "latency": latency(tables.get("latency", []), folder),
        "attempts": attempts(tables.get("attempts", []), folder),
        "backlog": backlog(tables.get("backlog_series", []), folder, end),
        "dead_letters": dead_letters(tables.get("dead_letters", []), folder),
    }
    return {name: png for name, png in drawn.items() if png}

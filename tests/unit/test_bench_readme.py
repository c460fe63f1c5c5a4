"""bench/README.md's table names every file of bench/: a script added without a row is
a figure nobody can find the command of."""

from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_every_bench_file_has_a_row():
    table = "\n".join(line for line in (BENCH / "README.md").read_text().splitlines() if line.startswith("| `"))
    named = set(re.findall(r"`([A-Za-z0-9_]+\.(?:py|sh|sql))`", table))
    files = {p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh", ".sql") and p.name != "__init__.py"}
    assert sorted(files - named) == [], "add rows for these to bench/README.md"
    assert sorted(named - files) == [], "bench/README.md has rows for files that are gone"

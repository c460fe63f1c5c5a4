"""Import a script of ``bench/`` into a test without shadowing installed packages.

Why: ``bench/`` holds scripts whose names are also those of clients the tests use
(``bench/nsq.py`` against pynsq's ``nsq``), and every bench script puts its own
directory first on ``sys.path`` when imported. Left there, it makes any later
``import nsq`` in the same pytest process find the benchmark instead of pynsq, so
which tests pass would depend on the order the test files run in. Here the bench
directory is first only while the script itself is imported, then moved to the end of
``sys.path``: the scripts' lazy imports of their private siblings (``_report``,
``_nsq_load``, ...) still resolve, and nothing installed is shadowed.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = str(Path(__file__).resolve().parents[1] / "bench")


def import_bench(name: str) -> ModuleType:
    """The module ``bench/<name>.py``, with ``bench/`` left last on ``sys.path``."""
    saved = [entry for entry in sys.path if entry != BENCH]
    sys.path.insert(0, BENCH)
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = [entry for entry in saved if entry != BENCH] + [BENCH]

"""Importing a bench script in a test leaves installed packages first on the path.

``bench/nsq.py`` shares its name with pynsq's ``nsq``; the compatibility tests import
pynsq in the same pytest process as the unit tests that import bench scripts, in
whichever order pytest is given the files. This holds that order out of the result.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tests.bench_modules import BENCH, import_bench


def test_after_every_bench_import_nsq_is_still_pynsq():
    for name in ("channel_cost", "message_cost", "nsq_cost", "nsq_backlog_cost", "_nsq_load", "reliable", "latency"):
        import_bench(name)
        spec = importlib.util.find_spec("nsq")
        assert spec is not None and spec.origin is not None
        assert Path(spec.origin).resolve().parent != Path(BENCH), name
    assert sys.path[-1] == BENCH and sys.path.count(BENCH) == 1


def test_a_bench_scripts_lazy_sibling_imports_still_resolve():
    import_bench("reliable")
    report = importlib.import_module("_report")  # reliable.py imports it inside a function
    assert Path(report.__file__).resolve().parent == Path(BENCH)

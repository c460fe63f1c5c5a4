"""The chaos tier: one cluster (ZooKeeper, three Patroni members, three dmq nodes, the
fault proxies) per module, faults injected one scenario at a time; it is stopped when
the module is done, so the tiers after it do not share the machine with it.

Each scenario restores the cluster when it is done (``ChaosCluster.restore``), so the
next one starts whole. The reports (counts, outage, recovery, throughput) are printed
at the end of the run, passed or failed: they are the suite's result, not only its
verdict. ``bench/chaos.py`` runs the same scenarios for longer.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .cluster import ChaosCluster, available
from .scenarios import NODE_FLAGS

REPORTS: list[str] = []


def pytest_collection_modifyitems(items):
    """Without Patroni, faketime, ZooKeeper and PostgreSQL's server the tier cannot run:
    a collection error naming the fix (they are installed by setup, never skipped)."""
    if not any("tests/chaos/" in str(item.fspath) for item in items):
        return
    missing = available()
    if missing:
        raise pytest.UsageError(
            f"the chaos tier needs {', '.join(missing)}: bash deploy/setup.sh --dev installs them"
        )


@pytest.fixture(scope="module")
def chaos_cluster() -> Iterator[ChaosCluster]:
    cluster = ChaosCluster(flags=NODE_FLAGS).start()
    try:
        yield cluster
    finally:
        cluster.close()


def pytest_terminal_summary(terminalreporter):
    if REPORTS:
        terminalreporter.section("chaos reports")
        for report in REPORTS:
            terminalreporter.write_line(report)

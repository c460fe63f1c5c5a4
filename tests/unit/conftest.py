"""Unit-test fixtures: each test starts with no database outage under way (``db.outage``
keeps one process-wide ``Dependency`` for PostgreSQL, as the log is process-wide, with
the components it wakes when an outage ends)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dmq_server.db.outage import POSTGRESQL


@pytest.fixture(autouse=True)
def _no_outage_under_way() -> Iterator[None]:
    POSTGRESQL.since, POSTGRESQL.failures = None, 0
    POSTGRESQL.waiting.clear()
    yield
    POSTGRESQL.since, POSTGRESQL.failures = None, 0
    POSTGRESQL.waiting.clear()

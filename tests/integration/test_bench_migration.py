"""``bench/migration.py`` times the migrations after a version on a database holding
messages (docs/operations.md quotes it for schema version 12): run small, it migrates
every later version and the messages are all still there."""

from __future__ import annotations

import pytest

from dmq_sql import migrations
from tests.bench_modules import import_bench

pytestmark = pytest.mark.integration


def test_it_applies_every_later_migration_to_a_filled_database():
    bench = import_bench("migration")
    result = bench.run(10, 500, 3)
    assert result["applied"] == [v for v, _, _ in migrations() if v > 10]
    assert result["migrate_s"] > 0 and result["fill_s"] > 0
    assert result["messages_after"] == 500

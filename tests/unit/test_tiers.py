"""The test tiers mean what they say: ``-m unit`` is exactly tests/unit, and a unit test
cannot reach for PostgreSQL (tests/conftest.py refuses to collect it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFTEST = (REPO / "tests" / "conftest.py").read_text()


def _collect(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd, capture_output=True, text=True, timeout=120,
    )


def test_the_unit_marker_selects_exactly_the_unit_folder(tmp_path):
    """A tree with a test in every tier's folder (the real conftest): ``-m unit`` collects
    the unit one only. (Collecting the real suite took 20 s of every CI run; a test in
    another folder claiming the unit marker is refused by every collection anyway: below.)"""
    for folder in ("unit", "integration", "zk", "compat", "pipeline", "chaos"):
        _tree(tmp_path, folder, f"def test_in_{folder}():\n    pass\n")
    out = _collect(tmp_path, "-m", "unit", "tests")
    assert out.returncode == 0, out.stdout + out.stderr
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    assert ids == ["tests/unit/test_probe.py::test_in_unit"], out.stdout
    everything = [line for line in _collect(tmp_path, "tests").stdout.splitlines() if "::" in line]
    assert len(everything) == 6, everything


def _tree(tmp_path: Path, folder: str, body: str) -> Path:
    (tmp_path / "tests" / folder).mkdir(parents=True)
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tmp_path / "tests" / folder / "__init__.py").write_text("")
    (tmp_path / "tests" / "conftest.py").write_text(CONFTEST)
    (tmp_path / "tests" / folder / "test_probe.py").write_text(body)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    unit\n    integration\n    zk\n    compat\n    pipeline\n    chaos\n")
    return tmp_path


def test_a_unit_test_asking_for_postgresql_is_refused(tmp_path):
    root = _tree(tmp_path, "unit", "def test_probe(pg_dsn):\n    pass\n")
    out = _collect(root, "tests")
    assert out.returncode != 0
    assert "a unit test may not use ['pg_dsn', 'pg_server']" in out.stdout + out.stderr


def test_a_test_claiming_another_tier_is_refused(tmp_path):
    body = "import pytest\n\n@pytest.mark.integration\ndef test_probe():\n    pass\n"
    out = _collect(_tree(tmp_path, "unit", body), "tests")
    assert out.returncode != 0
    assert "in tests/unit/ but marked ['integration']" in out.stdout + out.stderr


def test_a_plain_unit_test_is_collected_with_its_tier(tmp_path):
    out = _collect(_tree(tmp_path, "unit", "def test_probe():\n    pass\n"), "-m", "unit", "tests")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tests/unit/test_probe.py::test_probe" in out.stdout

"""deploy/setup.sh says what it does on a first run and nothing on the fast path.

Run on a copy of the script in a scratch "repository" whose .venv Python is a stub
that records its calls, so no package is installed and no network is used."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

SETUP = Path(__file__).resolve().parents[2] / "deploy" / "setup.sh"

STUB = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/calls"
case "$1" in
  -V) echo "Python 3.11.2" ;;
esac
exit 0
"""


def _scratch_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "deploy").mkdir(parents=True)
    shutil.copy(SETUP, repo / "deploy" / "setup.sh")
    (repo / "pyproject.toml").write_text("[project]\nname = 'dmq'\n")
    python = repo / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(STUB)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return repo


def _run(repo: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=str(repo / ".venv" / "bin" / "python"))
    return subprocess.run(
        ["bash", str(repo / "deploy" / "setup.sh")], capture_output=True, text=True, env=env, timeout=60
    )


def test_first_run_says_each_step_and_second_run_is_silent(tmp_path):
    repo = _scratch_repo(tmp_path)
    first = _run(repo)
    assert first.returncode == 0, first.stderr
    assert first.stdout == ""  # progress goes to stderr: callers may capture stdout
    lines = first.stderr.splitlines()
    assert lines == [
        f"deploy/setup.sh: upgrading pip in {repo}/.venv",
        f"deploy/setup.sh: installing dmq with extras [embedded] and its dependencies into {repo}/.venv "
        "(a few minutes the first time)",
        f"deploy/setup.sh: done: dmq is installed in {repo}/.venv",
    ]
    calls = (repo / ".venv" / "bin" / "calls").read_text()
    assert "-m pip install -qq -e .[embedded]" in calls

    second = _run(repo)
    assert second.returncode == 0 and second.stdout == "" and second.stderr == ""

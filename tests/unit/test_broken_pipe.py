"""Every command line's entry point ends quietly when the reader of its output is gone
(`dmq ... | head`): exit 141, as if SIGPIPE had ended it, and no traceback.

The read end of the pipe is closed before the command starts, so its first write
meets a closed pipe whatever the timing. The command body is replaced by one that
prints more than a pipe holds (argparse's --help swallows the error itself, and the
real commands need a database); the real listing case is in
tests/integration/test_cli_ops.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

LOUD = "lambda *a: print('x' * 200_000) or 0"

CHILDREN = {
    "dmq": f"import dmq_server.admin.cli as m\nm.cmd_stats = {LOUD}\nsys.exit(m.main(['stats']))",
    # (without _serve, main would start a real server: fail instead)
    "dmq-server": f"import dmq_server.main as m\nassert hasattr(m, '_serve')\nm._serve = {LOUD}\nsys.exit(m.main([]))",
    "dmq-pipeline": (
        "import argparse, dmq_pipeline.cli as m\n"
        "p = argparse.ArgumentParser(); p.add_argument('--log-level', default='warning')\n"
        f"p.set_defaults(func={LOUD})\n"
        "m.build_parser = lambda: p\n"
        "sys.exit(m.main([]))"
    ),
}


@pytest.mark.parametrize("command", sorted(CHILDREN))
def test_entry_point_into_a_closed_pipe_exits_141_without_traceback(command):
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, "-c", "import sys\n" + CHILDREN[command]],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 141, result.stderr
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr

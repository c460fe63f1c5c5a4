"""The admin CLI does not load the broker: every ``dmq`` command (and every test that runs
one) paid 0.25 s of a 0.6 s start for modules it never runs (the broker, its stores and
channels), through one run-time import of a type."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
from dmq_server.admin.cli import build_parser
build_parser()
print(sorted(m for m in sys.modules if m.startswith(("dmq_server.broker", "dmq_server.reliable", "dmq_server.fast"))))
"""


def test_the_cli_parser_loads_no_broker_or_store_module():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

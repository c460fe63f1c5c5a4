"""The type checker passes on the packages it covers (``[tool.mypy]`` in pyproject.toml).

mypy reads the annotations the code already has and finds where they disagree (a
socket that may be a TLS layer, a file descriptor that may be None, a body that may
still be text), before a user does. It covers the client library and the registry's
model today; the server joins as its objects get types of their own (issue 43: the
seam between adapters and the broker is a ``typing.Protocol``). pyproject pins the
version in the dev extra, so a new release cannot turn the suite red by itself.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_typed_packages_pass_the_type_checker():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    assert {"dmq_client", "registry"} <= set(config["packages"])
    done = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert done.stdout.startswith("Success"), done.stdout

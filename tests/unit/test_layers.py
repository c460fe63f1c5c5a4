"""The import contracts in pyproject.toml (``[tool.importlinter]``) hold.

They are what keeps the layers apart as the code grows: the client library never
pulls in the server, the wire codecs stay sans-IO (standard library only), nothing
below the pipeline imports it. A wrong import fails here, naming the import chain.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_import_contracts_are_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout

"""The two distributions build, and the client one is light.

``dmq-server`` (the repository's pyproject.toml: server, CLI, SQL, pipeline) requires
``dmq-client`` (client/pyproject.toml: the client library and the registry's model) at
the same version. The client's wheel, installed alone into a bare virtualenv, must work
with none of Twisted, psycopg, kazoo or APScheduler: a service that only sends and
receives should not carry the server's dependencies.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SERVER_DEPS = ("twisted", "psycopg", "kazoo", "apscheduler")


def _source(tmp_path: Path) -> Path:
    """A copy of what the two distributions are built from (setuptools builds in the
    source tree, leaving build/ behind: not in the checkout)."""
    src = tmp_path / "src"
    for name in ("dmq_server", "dmq_client", "registry", "dmq_pipeline", "sql", "client"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    return src


def _wheel(project: Path, out: Path) -> Path:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
         str(project)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    return wheel


def _metadata(wheel: Path) -> tuple[dict, list[str], list[str]]:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(zf.read(meta_name).decode())
    return dict(meta.items()), meta.get_all("Requires-Dist") or [], names


def test_the_client_wheel_is_light_and_works_alone(tmp_path):
    wheel = _wheel(_source(tmp_path) / "client", tmp_path / "client")
    meta, requires, names = _metadata(wheel)
    assert meta["Name"] == "dmq-client"
    # every requirement is optional (the zk extra), none of the server's is unconditional
    assert all("extra ==" in r for r in requires), requires
    assert {n.split("/")[0] for n in names if not n.startswith("dmq_client-")} == {"dmq_client", "registry"}

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    probe = (
        "import sys\n"
        "from dmq_client import MqClient, MqConfig, Message\n"
        "from dmq_client.blocking import BlockingClient\n"
        "from dmq_client.wire import Command, encode\n"
        "import dmq_client.discovery, registry.paths\n"
        f"loaded = sorted(m for m in {SERVER_DEPS!r} if m in sys.modules)\n"
        "print(MqClient.__name__, BlockingClient.__name__, Command.SEND_SUCCESS_ACK.name, loaded)\n"
    )
    ran = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.strip() == "MqClient BlockingClient SEND_SUCCESS_ACK []"
    for dep in SERVER_DEPS:
        absent = subprocess.run([str(python), "-c", f"import {dep}"], capture_output=True, timeout=60, cwd=tmp_path)
        assert absent.returncode != 0, f"{dep} is importable in the client-only venv"


def test_the_server_wheel_requires_the_client_at_its_version(tmp_path):
    wheel = _wheel(_source(tmp_path), tmp_path / "server")
    meta, requires, names = _metadata(wheel)
    client = tomllib.loads((REPO / "client" / "pyproject.toml").read_text())["project"]
    assert meta["Name"] == "dmq-server"
    assert f"dmq-client=={client['version']}" in requires
    assert meta["Version"] == client["version"]
    tops = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert tops == {"dmq_server", "dmq_pipeline", "dmq_sql"}, "dmq_client and registry come from dmq-client"

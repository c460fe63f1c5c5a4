"""The two distributions build, install without the repository and run.

``dmq-server`` (the repository's pyproject.toml: server, CLI, SQL, pipeline) requires
``dmq-client`` (client/pyproject.toml: the client library and the registry's model) at
the same version. Every test here runs on what a user gets, not on the editable
install the other tests use: wheels and sdists built from a copy of the source, and a
wheel built from each sdist (pip's path for an sdist). Both package lists are found by
setuptools' discovery; these tests are what notices a folder that did not make it into
a wheel (a hand-kept list once left out ``dmq_server.broker``, and a server installed
from that wheel could not start).

The client's wheel, installed alone into a bare virtualenv, must work with none of
Twisted, psycopg, kazoo or APScheduler: a service that only sends and receives should
not carry the server's dependencies.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

import pytest

from dmq_server.db.embedded import EmbeddedPostgres

from .support import free_port, http_get, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SERVER_DEPS = ("twisted", "psycopg", "kazoo", "apscheduler")
#: each distribution's top-level packages -> the repository folder it is built from
PACKAGES = {
    "dmq-server": {"dmq_server": "dmq_server", "dmq_pipeline": "dmq_pipeline", "dmq_sql": "sql"},
    "dmq-client": {"dmq_client": "dmq_client", "registry": "registry"},
}
SKIPPED = ("__pycache__", "*.pyc", "build", "*.egg-info")


@dataclass(frozen=True)
class Built:
    """One distribution as a user may get it."""

    wheel: Path  # built from the source tree (pip install ., a wheel on an index)
    sdist: Path
    wheel_from_sdist: Path  # what pip builds from the sdist


def _source(root: Path) -> Path:
    """A copy of what the two distributions are built from, links kept as links (as in a
    checkout: dmq_sql -> sql, client/dmq_client -> ../dmq_client); setuptools builds in
    the source tree, leaving build/ and *.egg-info behind: not in the checkout."""
    src = root / "src"
    src.mkdir()
    for name in ("dmq_server", "dmq_client", "registry", "dmq_pipeline", "sql", "dmq_sql", "client",
                 "pyproject.toml", "README.md"):
        path = REPO / name
        if path.is_symlink():
            (src / name).symlink_to(os.readlink(path))
        elif path.is_dir():
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns(*SKIPPED))
        else:
            shutil.copy(path, src / name)
    return src


def _build(project: Path, hook: str, out: Path) -> Path:
    """Run setuptools' PEP 517 hook (``build_wheel`` or ``build_sdist``) in ``project``,
    as a build frontend without isolation does; the path of what it built."""
    out.mkdir(parents=True)
    done = subprocess.run(
        [sys.executable, "-c",
         f"import sys; from setuptools import build_meta; print(build_meta.{hook}(sys.argv[1]))", str(out)],
        cwd=project, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, f"{hook} in {project} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return out / done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Built]:
    """Both distributions, built once for this module's tests."""
    root = tmp_path_factory.mktemp("dists")
    src = _source(root)
    built = {}
    for name, project in (("dmq-client", src / "client"), ("dmq-server", src)):
        out = root / name
        sdist = _build(project, "build_sdist", out / "sdist")
        with tarfile.open(sdist) as tar:
            tar.extractall(out / "unpacked", filter="data")
        (unpacked,) = (out / "unpacked").iterdir()
        built[name] = Built(_build(project, "build_wheel", out / "wheel"), sdist,
                            _build(unpacked, "build_wheel", out / "from-sdist"))
    return built


def _venv(venv: Path, *install: str) -> None:
    """A fresh virtualenv and ``pip install *install`` into it, with this environment's
    pip (``--python``): no pip of its own to set up first, seconds saved."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
         "--disable-pip-version-check", *install],
        cwd=venv, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, f"pip install {' '.join(install)} failed:\n{done.stderr[-3000:]}"


def _metadata(wheel: Path) -> tuple[dict, list[str], list[str]]:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(zf.read(meta_name).decode())
    return dict(meta.items()), meta.get_all("Requires-Dist") or [], names


def _source_files(dist: str) -> set[str]:
    """Every file of a distribution's packages in the repository, as installed paths
    (``sql/queries.sql`` is ``dmq_sql/queries.sql``): code and package data alike."""
    files = set()
    for package, folder in PACKAGES[dist].items():
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files.add(f"{package}/{path.relative_to(REPO / folder).as_posix()}")
    return files


def _module(path: str) -> str:
    """``dmq_server/broker/__init__.py`` -> ``dmq_server.broker``."""
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _source_modules() -> set[str]:
    return {_module(f) for dist in PACKAGES for f in _source_files(dist) if f.endswith(".py")}


def test_the_client_wheel_is_light_and_works_alone(dists, tmp_path):
    wheel = dists["dmq-client"].wheel
    meta, requires, names = _metadata(wheel)
    assert meta["Name"] == "dmq-client"
    # every requirement is optional (the zk extra), none of the server's is unconditional
    assert all("extra ==" in r for r in requires), requires
    assert {n.split("/")[0] for n in names if not n.startswith("dmq_client-")} == {"dmq_client", "registry"}
    assert "dmq_client/py.typed" in names  # PEP 561: type checkers read dmq_client's annotations

    venv = tmp_path / "venv"
    _venv(venv, "--no-deps", "--no-index", str(wheel))
    python = venv / "bin" / "python"
    probe = (
        "import sys\n"
        "from dmq_client import MqClient, MqConfig, Message\n"
        "from dmq_client.blocking import BlockingClient\n"
        "from dmq_client.wire import Command, encode\n"
        "import dmq_client.discovery, dmq_client.aio, registry.paths\n"
        f"loaded = sorted(m for m in {SERVER_DEPS!r} if m in sys.modules)\n"
        "print(MqClient.__name__, BlockingClient.__name__, Command.SEND_SUCCESS_ACK.name, loaded)\n"
    )
    ran = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.strip() == "MqClient BlockingClient SEND_SUCCESS_ACK []"
    for dep in SERVER_DEPS:
        absent = subprocess.run([str(python), "-c", f"import {dep}"], capture_output=True, timeout=60, cwd=tmp_path)
        assert absent.returncode != 0, f"{dep} is importable in the client-only venv"


def test_the_server_wheel_requires_the_client_at_its_version(dists):
    meta, requires, names = _metadata(dists["dmq-server"].wheel)
    client = tomllib.loads((REPO / "client" / "pyproject.toml").read_text())["project"]
    assert meta["Name"] == "dmq-server"
    assert f"dmq-client=={client['version']}" in requires
    assert meta["Version"] == client["version"]
    tops = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert tops == {"dmq_server", "dmq_pipeline", "dmq_sql"}, "dmq_client and registry come from dmq-client"


@pytest.mark.parametrize("dist", sorted(PACKAGES))
def test_every_file_of_the_packages_is_in_the_wheel_and_the_sdist(dists, dist):
    """Every module and data file under the distribution's folders is in its wheel, in its
    sdist and in the wheel pip builds from that sdist; nothing else is."""
    expected = _source_files(dist)
    built = dists[dist]
    for wheel in (built.wheel, built.wheel_from_sdist):
        with zipfile.ZipFile(wheel) as zf:
            shipped = {n for n in zf.namelist() if ".dist-info/" not in n}
        assert not expected - shipped, f"missing from {wheel.parent.name}/{wheel.name}: {sorted(expected - shipped)}"
        assert not shipped - expected, f"not in the source tree, yet in {wheel.name}: {sorted(shipped - expected)}"
    with tarfile.open(built.sdist) as tar:
        members = [m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()]
    assert not [m for m in members if ".." in m.split("/")], members
    missing = expected - set(members)
    assert not missing, f"missing from {built.sdist.name}: {sorted(missing)}"


# --- the installed wheels, outside the repository -------------------------------------

PROBE = """\
import importlib, json, pkgutil, sys
found, failed, files = [], {}, {}
def note(name):
    failed[name] = "{0.__name__}: {1}".format(*sys.exc_info()[:2])
for top in sys.argv[1:]:
    package = importlib.import_module(top)
    files[top] = package.__file__
    found.append(top)
    found += [m.name for m in pkgutil.walk_packages(package.__path__, top + ".", onerror=note)]
for name in found:
    try:
        importlib.import_module(name)
    except BaseException:
        note(name)
print(json.dumps({"prefix": sys.prefix, "files": files, "modules": found, "failed": failed}))
"""

ROUND_TRIP = """\
import json, sys
import dmq_client
from dmq_client import Message, MqClient, MqConfig
from dmq_client.blocking import BlockingClient
port = int(sys.argv[1])
with MqClient(MqConfig(servers=f"127.0.0.1:{port}")) as client:
    sent = client.send(Message("orders", b"from the installed wheel")).result(timeout=30)
with BlockingClient("127.0.0.1", port, timeout=30) as consumer:
    consumer.subscribe("orders", "billing", credit=10)
    push = consumer.receive(timeout=30)
    assert push is not None, "nothing was pushed"
    consumer.ack(push)
print(json.dumps({"status": sent.status.name, "same_id": sent.message_id == push.message_id,
                  "body": push.body.decode(), "dmq_client": dmq_client.__file__}))
"""


class Outside:
    """A fresh virtualenv holding the two wheels (not editable), and commands run in it
    from a directory that is not the repository, with no PYTHONPATH and no path into
    the repository on PATH."""

    def __init__(self, root: Path):
        self.venv = root / "venv"
        self.cwd = root / "elsewhere"
        self.cwd.mkdir()
        self.timings: dict[str, float] = {}
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("DMQ_")}
        path = [p for p in env.get("PATH", "").split(os.pathsep)
                if p and not Path(p).resolve().is_relative_to(REPO)]
        env["PATH"] = os.pathsep.join([str(self.venv / "bin"), *path])
        self.env = env

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def install(self, server: Path, client: Path) -> None:
        """``pip install`` of both wheels with the server's embedded and pipeline extras;
        their dependencies come from the index or pip's cache."""
        started = time.monotonic()
        _venv(self.venv, f"{server}[embedded,pipeline]", str(client))
        self.timings["venv and pip install"] = time.monotonic() - started

    def run(self, name: str, *args: str, timeout: float = 120) -> str:
        done = subprocess.run([self.bin(name), *args], cwd=self.cwd, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{name} {' '.join(args)} exited {done.returncode}:\n" \
                                     f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    def python(self, code: str, *args: str) -> str:
        return self.run("python", "-c", code, *args)


def test_the_installed_wheels_run_the_server_outside_the_repository(dists, scratch_dir):
    """Built from the sdists, installed non-editable into a fresh virtualenv outside the
    repository, run from elsewhere: dmq-server starts on the embedded PostgreSQL of the
    ``embedded`` extra, the dmq CLI registers a topic, dmq_client sends and receives,
    the web console's files are served, dmq-pipeline answers, and every module of the
    five packages imports; nothing is missing from what is installed.

    ``scratch_dir`` (mode 755), not tmp_path: as root, the embedded PostgreSQL runs as an
    unprivileged user, which must run the binaries of the venv's pgserver."""
    outside = Outside(scratch_dir)
    outside.install(dists["dmq-server"].wheel_from_sdist, dists["dmq-client"].wheel_from_sdist)
    site = Path(outside.python("import sysconfig; print(sysconfig.get_path('purelib'))").strip())

    # every module of the source tree is installed and imports, from the venv's site-packages
    started = time.monotonic()
    probe = json.loads(outside.python(PROBE, *(p for packages in PACKAGES.values() for p in packages)))
    outside.timings["import every module"] = time.monotonic() - started
    assert Path(probe["prefix"]) == outside.venv
    for top, file in probe["files"].items():
        assert Path(file).is_relative_to(site), f"{top} imported from {file}, not from {site}"
    missing = _source_modules() - set(probe["modules"])
    assert not missing, f"modules in the source tree that the installed wheels lack: {sorted(missing)}"
    assert not probe["failed"], f"installed modules that do not import: {probe['failed']}"
    assert set(probe["modules"]) == _source_modules()

    # PostgreSQL from the embedded extra, whatever the machine has besides
    bindir = Path(outside.python("from dmq_sql.embedded import pgserver_bindir; print(pgserver_bindir())").strip())
    assert bindir.is_relative_to(site), bindir
    outside.env["DMQ_PG_BINDIR"] = str(bindir)

    data = scratch_dir / "data"
    tcp, http = free_port(), free_port()
    log_path = scratch_dir / "dmq-server.log"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [outside.bin("dmq-server"), "--data-path", str(data), "--tcp-address", f"127.0.0.1:{tcp}",
             "--http-address", f"127.0.0.1:{http}", "--admin-address", f"127.0.0.1:{free_port()}"],
            cwd=outside.cwd, env=outside.env, stdout=log, stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{http}"

    def ready() -> bool:
        assert server.poll() is None, f"dmq-server exited {server.returncode}:\n{log_path.read_text()[-5000:]}"
        try:
            return http_get(base + "/ping", timeout=1)[0] == 200
        except OSError:
            return False

    try:
        wait_for(ready, timeout=120)  # initdb and the first start are part of it
        outside.timings["server ready"] = time.monotonic() - started
        assert "(embedded)" in log_path.read_text()

        cli = ("dmq", "--data-path", str(data))
        outside.run(*cli, "topic", "create", "orders")
        outside.run(*cli, "channel", "add", "orders", "billing")
        assert "orders\treliable\tchannels: billing" in outside.run(*cli, "topic", "list")

        trip = json.loads(outside.python(ROUND_TRIP, str(tcp)))
        assert trip["status"] == "SUCCESS" and trip["same_id"], trip
        assert trip["body"] == "from the installed wheel"
        assert Path(trip["dmq_client"]).is_relative_to(site), trip["dmq_client"]

        static = REPO / "dmq_server" / "http" / "static"
        for path, name in (("/console/", "index.html"), ("/console/app.js", "app.js"),
                           ("/console/style.css", "style.css")):
            assert http_get(base + path) == (200, (static / name).read_text()), path

        assert "usage: dmq-pipeline" in outside.run("dmq-pipeline", "--help")

        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0, log_path.read_text()[-5000:]
        assert f":{tcp} stopped" in log_path.read_text()  # "dmq node HOST:PORT stopped"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
        EmbeddedPostgres(data).kill()  # a PostgreSQL left behind by a failure
        print("timings (s):", {k: round(v, 1) for k, v in outside.timings.items()})

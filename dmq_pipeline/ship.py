"""The executors' Python: a packed virtualenv with dmq, shipped with the job.

``report`` and ``replay`` run dmq's code on the executors (``replay`` sends with
``dmq_client`` and records with psycopg), and a cluster's workers have no dmq.
``--ship-env`` gives them this installation's: a virtualenv holding the packages the
executors import (``dmq_client``, ``registry``, ``dmq_pipeline``, ``dmq_sql``, and
psycopg with what it requires), packed as ``.tar.gz`` and shipped with
``spark.archives=<archive>#env``; the executors unpack it in their working directory
and run ``PYSPARK_PYTHON=./env/bin/python``.

The environment is built by copying what is installed here (no index, no network,
the very code the driver runs) into a new ``python -m venv --without-pip``, whose
``bin/python`` is a link to this interpreter's base Python: the workers need Python
of the same version at the same path (``sys.base_prefix``; the same OS image, or
the same ``pyenv``/``/usr/bin`` install). Where they differ, run
``dmq-pipeline pack-env --out env.tar.gz`` on a machine like the workers and ship
that file with ``--ship-env env.tar.gz``.

``--ship-env build`` caches the archive under ``$XDG_CACHE_HOME/dmq-pipeline``
(``~/.cache``), named by a hash of everything in it, so only a changed installation
is packed again.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata as metadata
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

from .errors import UsageError

__all__ = ["ENV_NAME", "PYTHON", "PACKAGES", "build_env", "cached_env", "shipped_archive"]

log = logging.getLogger(__name__)

#: The directory the executors unpack the archive into, and the Python they run.
ENV_NAME = "env"
PYTHON = f"./{ENV_NAME}/bin/python"
#: dmq's packages the executors import.
PACKAGES = ("dmq_client", "registry", "dmq_pipeline", "dmq_sql")
#: Distributions the executors import, with what they require.
DISTRIBUTIONS = ("psycopg", "psycopg-binary")


def _package_files(name: str) -> list[tuple[Path, str]]:
    """(source file, path inside site-packages) for one of dmq's packages."""
    root = Path(importlib.import_module(name).__file__).parent
    files = []
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            files.append((path, f"{name}/{path.relative_to(root)}"))
    return files


def _closure(names: tuple[str, ...]) -> list[metadata.Distribution]:
    """The installed distributions ``names`` and everything they require (markers
    evaluated for this interpreter, extras not followed)."""
    from packaging.requirements import Requirement

    found: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            if name in names and name != "psycopg-binary":  # psycopg may use the system's libpq
                raise UsageError(f"--ship-env: {name} is not installed here, so it cannot be shipped")
            continue
        found[key] = dist
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return [found[k] for k in sorted(found)]


def _distribution_files(dist: metadata.Distribution) -> list[tuple[Path, str]]:
    files = []
    for entry in dist.files or ():
        rel = str(entry)
        if rel.startswith("..") or "__pycache__" in rel or rel.endswith(".pyc"):
            continue  # scripts in bin/, byte code: not needed by the executors
        source = Path(dist.locate_file(entry))
        if source.is_file():
            files.append((source, rel))
    return files


def _contents() -> list[tuple[Path, str]]:
    files = [f for name in PACKAGES for f in _package_files(name)]
    for dist in _closure(DISTRIBUTIONS):
        files += _distribution_files(dist)
    return files


def _fingerprint(files: list[tuple[Path, str]]) -> str:
    digest = hashlib.sha256(f"{sys.version}|{sys._base_executable}".encode())  # type: ignore[attr-defined]
    for source, rel in files:
        st = source.stat()
        digest.update(f"{rel}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def build_env(out: Path, files: list[tuple[Path, str]] | None = None) -> Path:
    """Pack a virtualenv of dmq's executor packages into ``out`` (.tar.gz)."""
    files = _contents() if files is None else files
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dmq-ship-env-") as tmp:
        env = Path(tmp) / ENV_NAME
        made = subprocess.run(
            [sys._base_executable, "-m", "venv", "--without-pip", str(env)],  # type: ignore[attr-defined]
            capture_output=True, text=True,
        )
        if made.returncode != 0:
            raise UsageError(f"--ship-env: cannot create a virtualenv: {made.stderr.strip()[-500:]}")
        purelib = sysconfig.get_path("purelib", vars={"base": str(env), "platbase": str(env)})
        site = Path(purelib)
        for source, rel in files:
            target = site / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
        partial = out.with_name(out.name + f".{os.getpid()}.part")
        with tarfile.open(partial, "w:gz", compresslevel=1) as tar:
            for path in sorted(env.iterdir()):
                tar.add(path, arcname=path.name)  # bin/python stays a link to the base Python
        os.replace(partial, out)
    return out


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dmq-pipeline"


def cached_env(progress=lambda text: None) -> Path:
    """This installation's packed environment, built once per content."""
    files = _contents()
    path = cache_dir() / f"env-{_fingerprint(files)}.tar.gz"
    if not path.is_file():
        progress(f"packing dmq's Python environment for the executors into {path}")
        build_env(path, files)
    return path


def shipped_archive(value: str, progress=lambda text: None) -> str:
    """What ``--ship-env`` ships: ``build`` packs this installation (cached); anything
    else is a packed environment, a local file or a URI Spark can fetch."""
    if value == "build":
        return str(cached_env(progress))
    if "://" not in value:  # a local file (SparkOptions.validate checked it is there)
        return str(Path(value).expanduser().resolve())
    return value

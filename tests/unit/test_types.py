"""The type checker passes on the packages it covers (``[tool.mypy]`` in pyproject.toml).

mypy reads the annotations the code already has and finds where they disagree (a
socket that may be a TLS layer, a file descriptor that may be None, a body that may
still be text), before a user does. It covers the client library, the registry's
model, the server and the shared database tools, every module of them: no
``[[tool.mypy.overrides]]`` with ``ignore_errors`` is allowed (the last fifteen server
modules left that list in issue 43), so a module that starts failing cannot hide.
pyproject pins the version in the dev extra, so a new release cannot turn the suite
red by itself.

The client library, ``dmq_client``, is held to mypy's strict mode (issue 47): users
type-check their own code against it, and an ``Any`` that leaks out of it silently
turns their checks off. The override in pyproject.toml lists strict's flags for those
modules (``strict = true`` there would make the server strict too), and a second run
with ``--strict`` itself on the package holds that list to what strict means.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# How many modules an ignore_errors override may hold: none (it held 15 when the server
# joined the checker)
MOST_MODULES_LEFT_UNCHECKED = 0

ERROR_LINE = re.compile(r"^(\S+\.py):\d+: error:", re.M)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)  # strings and lists of strings: JSON is valid TOML here


def _overrides_toml(overrides) -> str:
    """The overrides other than ignore_errors ones (those are what the first run leaves
    out), as TOML tables."""
    return "".join(
        "[[tool.mypy.overrides]]\n" + "".join(f"{key} = {_toml_value(value)}\n" for key, value in override.items())
        for override in overrides if not override.get("ignore_errors"))


def _module_of(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def test_the_typed_packages_pass_the_type_checker(tmp_path):
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    assert {"dmq_client", "registry", "dmq_server", "dmq_sql"} <= set(config["packages"])
    unchecked = [name for override in config.get("overrides", []) if override.get("ignore_errors")
                 for name in ([override["module"]] if isinstance(override["module"], str)
                              else override["module"])]
    assert len(unchecked) <= MOST_MODULES_LEFT_UNCHECKED, (
        "the list of modules the type checker skips may only shrink: fix the types instead")
    assert not any(name.endswith("*") for name in unchecked), "name each skipped module"
    # one run without the override: the modules with errors must be exactly the listed
    # ones (none new, none that already pass), so the real configuration passes too
    plain = tmp_path / "mypy.toml"
    plain.write_text("[tool.mypy]\n" + "".join(
        f"{key} = {_toml_value(value)}\n" for key, value in config.items() if key != "overrides")
        + _overrides_toml(config.get("overrides", [])))
    done = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--config-file", str(plain)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stdout[-6000:] + done.stderr[-2000:]
    failing = {_module_of(path) for path in ERROR_LINE.findall(done.stdout)}
    new = sorted(failing - set(unchecked))
    assert not new, "type errors outside the override list:\n" + "\n".join(
        line for line in done.stdout.splitlines() if _module_of(line.split(":")[0]) in new)
    passing = sorted(set(unchecked) - failing)
    assert not passing, f"these modules pass now: take them out of [[tool.mypy.overrides]]: {passing}"


def test_the_client_library_passes_strict_mode(tmp_path):
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    strict = [override for override in config.get("overrides", []) if "dmq_client.*" in override["module"]]
    assert strict and "dmq_client" in strict[0]["module"], "dmq_client and its subpackages are held to strict mode"
    assert not strict[0].get("ignore_errors") and strict[0].get("disallow_untyped_defs")
    assert "strict" not in strict[0], "strict = true in an override makes every module strict, the server too"
    # mypy's own --strict on the package, with the repository's other settings (the
    # imports that have no stubs): what it finds in dmq_client is what the override
    # above missed. Modules the package imports from elsewhere (registry) are not held.
    plain = tmp_path / "mypy.toml"
    plain.write_text("[tool.mypy]\n" + "".join(
        f"{key} = {_toml_value(value)}\n" for key, value in config.items() if key not in ("overrides", "packages")))
    done = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--strict", "--config-file", str(plain),
                           "-p", "dmq_client"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stdout[-6000:] + done.stderr[-2000:]
    errors = [line for line in done.stdout.splitlines()
              if ERROR_LINE.match(line) and _module_of(line.split(":")[0]).split(".")[0] == "dmq_client"]
    assert not errors, "mypy --strict finds these in dmq_client:\n" + "\n".join(errors)

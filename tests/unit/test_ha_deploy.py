"""The HA deployment files stay true: the example Patroni config holds the settings the
local cluster runs with (synchronous and strict above all), and the scripts parse."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _patroni_local():
    spec = importlib.util.spec_from_file_location("patroni_local", DEPLOY / "patroni_local.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_config_has_the_local_clusters_dcs_settings():
    """deploy/patroni/pg1.yml.example and patroni_local.DCS_SETTINGS agree, so what the
    chaos suite proves is what production is told to run."""
    example = yaml.safe_load((DEPLOY / "patroni" / "pg1.yml.example").read_text())
    assert example["bootstrap"]["dcs"] == _patroni_local().DCS_SETTINGS
    dcs = example["bootstrap"]["dcs"]
    assert dcs["synchronous_mode"] is True and dcs["synchronous_mode_strict"] is True
    assert dcs["postgresql"]["parameters"]["synchronous_commit"] == "on"
    assert "zookeeper" in example


def test_a_local_member_config_matches_the_example_but_for_addresses(tmp_path):
    local = _patroni_local().member_config(
        "pg1", pg_port=5432, api_port=8008, data_dir=tmp_path / "data", run_dir=tmp_path,
        zk_hosts=["127.0.0.1:2181"], passwords={r: "x" for r in ("superuser", "replication", "rewind")},
        bindir=Path("/usr/lib/postgresql/15/bin"),
    )
    example = yaml.safe_load((DEPLOY / "patroni" / "pg1.yml.example").read_text())
    assert local["bootstrap"]["initdb"] == example["bootstrap"]["initdb"]
    assert local["scope"] == example["scope"] and local["namespace"] == example["namespace"]
    assert local["postgresql"]["listen"] == "127.0.0.1:5432"  # loopback only
    assert all(" 127.0.0.1/32 " in line for line in local["postgresql"]["pg_hba"] if line.startswith("host"))


def test_the_ha_scripts_are_valid_shell():
    for script in ("ha-local.sh", "cluster-local.sh"):
        subprocess.run(["bash", "-n", str(DEPLOY / script)], check=True)

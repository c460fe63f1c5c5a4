"""The cluster deployment files stay usable: the node config parses into valid options,
and the scripts are valid shell."""

from __future__ import annotations

import subprocess
from pathlib import Path

from dmq_server.options import Options, parse_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_cluster_node_config_parses_into_valid_options():
    """deploy/cluster/dmq-node.conf.example is a config the server accepts, with
    ZooKeeper set and the documented cluster timings."""
    path = DEPLOY / "cluster" / "dmq-node.conf.example"
    values = parse_config(path.read_text(), str(path))
    options = Options(**values).validate()
    assert options.zk.endswith("/dmq") and options.node_id == "dmq-1"
    assert options.zk_session_timeout == 10.0 and options.node_heartbeat == 30.0


def test_cluster_scripts_are_valid_shell():
    """bash -n accepts the local cluster script (it is run by hand, not by CI)."""
    subprocess.run(["bash", "-n", str(DEPLOY / "cluster-local.sh")], check=True)

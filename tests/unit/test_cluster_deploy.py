"""The cluster deployment files stay usable: the node config parses into valid options,
the scripts are valid shell, and the local cluster's readiness check only believes
answers from its own processes."""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dmq_server.core.options import Options, parse_config

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


# -- deploy/cluster_ready.py: readiness means *our* process answers ----------------------


def _cluster_ready():
    spec = importlib.util.spec_from_file_location("cluster_ready", DEPLOY / "cluster_ready.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Info(http.server.BaseHTTPRequestHandler):
    node_id = "node1"

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = json.dumps({"node_id": self.server.node_id}).encode()
        self.send_response(200 if self.path == "/info" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def info_server():
    """A stand-in HTTP server on a free port whose /info names ``server.node_id``."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Info)
    server.node_id = "someone-else"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


class _Clock:
    """Time that moves only when the code under test sleeps."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_readiness_is_not_fooled_by_another_server_on_the_port(info_server, tmp_path):
    """A foreign server answering /info on the node's HTTP port does not make the node
    ready: the check times out naming the other node id, and shows the node's log."""
    ready = _cluster_ready()
    port = info_server.server_address[1]
    log = tmp_path / "node1.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)) + "bind failed: address already in use\n")
    clock = _Clock()
    failure = ready.wait_ready(
        "node1", os.getpid(), lambda: ready.node_answers(port, "node1"), log, clock=clock, sleep=clock.sleep
    )
    assert "not ready after 60 s" in failure
    assert "another server answers" in failure and "'someone-else'" in failure
    assert failure.endswith("bind failed: address already in use\n")  # the log's tail...
    assert "line 0\n" not in failure  # ...not all of it
    assert clock.now >= 60


def test_readiness_passes_when_the_answer_names_our_node(info_server, tmp_path):
    ready = _cluster_ready()
    info_server.node_id = "node1"
    port = info_server.server_address[1]
    assert ready.node_answers(port, "node1") == ""
    clock = _Clock()
    assert ready.wait_ready(
        "node1", os.getpid(), lambda: ready.node_answers(port, "node1"), tmp_path / "log", clock=clock, sleep=clock.sleep
    ) == ""


def test_readiness_fails_at_once_when_the_process_exited(info_server, tmp_path):
    """Even while the port answers as our node, an exited process is not ready: the
    failure says so at once (no 60 s wait) with the log's tail."""
    ready = _cluster_ready()
    info_server.node_id = "node1"
    port = info_server.server_address[1]
    proc = subprocess.Popen(["true"])
    proc.wait()
    log = tmp_path / "node1.log"
    log.write_text("dmq-server: failed to start: migration failed\n")
    clock = _Clock()
    failure = ready.wait_ready(
        "node1", proc.pid, lambda: ready.node_answers(port, "node1"), log, clock=clock, sleep=clock.sleep
    )
    assert f"process {proc.pid} exited" in failure and "migration failed" in failure
    assert clock.now == 0


def test_ready_script_reports_the_foreign_server_and_the_log_tail(info_server, tmp_path):
    """What the cluster script prints: one clear failure and the node's log tail, exit 1
    (not a bash ERR trap quoting a heredoc). The node process here is already gone."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    log = tmp_path / "node1.log"
    log.write_text("Couldn't listen on 127.0.0.1:4151: [Errno 98] Address already in use.\n")
    port = info_server.server_address[1]
    result = subprocess.run(
        [sys.executable, str(DEPLOY / "cluster_ready.py"), "node", "node1", str(port), str(proc.pid), str(log)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("deploy/cluster-local.sh: node1: process")
    assert "Address already in use" in result.stderr and "EOF" not in result.stderr


def test_free_check_names_a_port_already_in_use(info_server):
    """Before starting, the script refuses ports something already listens on."""
    port = info_server.server_address[1]
    result = subprocess.run(
        [sys.executable, str(DEPLOY / "cluster_ready.py"), "free", str(port)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1 and f"127.0.0.1:{port}" in result.stderr
    assert _cluster_ready().ports_in_use([port]) == [port]

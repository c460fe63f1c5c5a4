"""A Spark standalone cluster on loopback whose workers behave like other machines.

A master and two workers started from the installed PySpark with ``spark-class``, as an
operator starts them, each in its own process group. The workers get an environment of
their own: ``PATH=/usr/bin:/bin`` (whose ``python3``, if any, has no dmq), no
``PYTHONPATH``, no virtualenv, their own work and scratch directories, and a working
directory outside the repository: dmq reaches their executors only through what the job
ships (``--ship-env``). Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

from tests.integration.support import free_port, wait_for

WORKER_CORES = 2
WORKERS = 2
WORKER_MEMORY = "1g"
#: what every job on the cluster asks for, within the workers' memory
EXECUTOR_CONF = ("spark.executor.memory=512m",)


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


class StandaloneCluster:
    def __init__(self, base: Path):
        self.base = base
        self.port = free_port()
        self.master = f"spark://127.0.0.1:{self.port}"
        self.procs: list[tuple[str, subprocess.Popen]] = []
        (base / "conf").mkdir(parents=True)

    def machine_env(self, name: str) -> dict[str, str]:
        """What a daemon (and its executors) sees: nothing of this checkout or its venv."""
        java = shutil.which("java")
        path = "/usr/bin:/bin"
        if java and os.path.dirname(os.path.realpath(java)) not in path.split(":"):
            path = f"{os.path.dirname(java)}:{path}"
        env = {
            "HOME": str(self.base / name),
            "PATH": path,
            "LANG": "C.UTF-8",
            "SPARK_HOME": str(spark_home()),
            "SPARK_CONF_DIR": str(self.base / "conf"),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_LOCAL_DIRS": str(self.base / name / "scratch"),
        }
        if os.environ.get("JAVA_HOME"):
            env["JAVA_HOME"] = os.environ["JAVA_HOME"]
        return env

    def _start(self, name: str, *args: str) -> Path:
        home = self.base / name
        (home / "scratch").mkdir(parents=True)
        log = home / "daemon.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [str(spark_home() / "bin" / "spark-class"), *args],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.machine_env(name), cwd=home, start_new_session=True,
            )
        self.procs.append((name, proc))
        return log

    def start(self) -> "StandaloneCluster":
        log = self._start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                          "--port", str(self.port), "--webui-port", "0")
        wait_for(lambda: "Starting Spark master at" in log.read_text(), timeout=90, interval=0.2)
        logs = [
            self._start(f"worker{i}", "org.apache.spark.deploy.worker.Worker", self.master, "--host", "127.0.0.1",
                        "--cores", str(WORKER_CORES), "--memory", WORKER_MEMORY,
                        "--work-dir", str(self.base / f"worker{i}" / "work"), "--webui-port", "0")
            for i in range(1, WORKERS + 1)
        ]
        for log in logs:
            wait_for(lambda log=log: "Successfully registered with master" in log.read_text(), timeout=90,
                     interval=0.2)
        return self

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{(self.base / name / 'daemon.log').read_text()[-3000:]}"
                         for name, _ in self.procs)

    def stop(self) -> None:
        for _, proc in reversed(self.procs):  # workers first: each ends its executors
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for _, proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

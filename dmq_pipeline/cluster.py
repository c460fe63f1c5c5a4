"""What changes when the executors are other machines: checks before Spark starts, and
how many executor cores a job has.

On ``local[...]`` the executors are threads of this machine: every path, every
127.0.0.1 address and this interpreter are theirs too. On any other master they are
processes on the cluster's machines, with their own disks and their own loopback, and
each trap below fails late and obscurely (a raw Hadoop traceback, a report whose
Parquet holds only ``_SUCCESS``, a connection refused on an executor). So before Spark
starts, the jobs refuse, with the fix in the message:

* a plain path or ``file:`` URI as the archive (the executors write and read it, each
  on its own disk), unless ``--archive-shared`` says it is a mount every machine has;
* a loopback database (the embedded PostgreSQL listens on 127.0.0.1 only, or a DSN
  naming 127.0.0.1 or localhost) or a loopback ``--server``, unless the master itself
  is on this machine (``spark://127.0.0.1:7077``: then so are its workers).

Names are never resolved here (no DNS query for a check): only ``localhost`` and
literal loopback addresses count as loopback.

``executor_cores`` is what ``--partitions 0`` means on a cluster. Spark's default
parallelism counts the cores registered so far, and executors join a few seconds after
the session starts (an 8-core cluster gave 4 partitions, then 8 fifteen seconds
later), so it waits for them: for the cores the configuration promises
(``spark.cores.max``, or ``spark.executor.instances`` x ``spark.executor.cores``) when it
says, else until no executor has joined for ``SETTLE_S`` seconds.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import time
from typing import Callable

from .errors import JobFailed, UsageError

__all__ = [
    "is_local",
    "on_this_machine",
    "is_loopback",
    "local_path",
    "check_location",
    "check_reachable",
    "executor_cores",
]

log = logging.getLogger(__name__)

#: Longest wait for the first executor of a cluster job.
FIRST_EXECUTOR_S = 60.0
#: Executors that joined together: none more for this long means all are there.
SETTLE_S = 3.0
#: Longest wait for the rest once the first has joined (Spark's own
#: spark.scheduler.maxRegisteredResourcesWaitingTime default).
MORE_EXECUTORS_S = 30.0

_URI = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*):")


def is_local(master: str) -> bool:
    """``local``, ``local[4]``, ``local[*]``, ``local[2,3]``: executors are this process."""
    return master == "local" or master.startswith("local[")


def _master_hosts(master: str) -> list[str] | None:
    """The hosts a ``spark://`` URL names (HA masters are comma-separated); None for
    masters whose machines are not in the URL (yarn, k8s://, mesos://)."""
    if not master.startswith("spark://"):
        return None
    hosts = []
    for part in master[len("spark://"):].split(","):
        hostport = part.split("/", 1)[0]
        if hostport.startswith("["):
            hosts.append(hostport[1:].split("]", 1)[0])
        else:
            hosts.append(hostport.rsplit(":", 1)[0] if ":" in hostport else hostport)
    return hosts


def is_loopback(host: str) -> bool:
    """``localhost`` or a literal loopback address; a name is never looked up."""
    host = host.strip().strip("[]").lower()
    if host in ("localhost", "localhost.localdomain") or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def on_this_machine(master: str) -> bool:
    """Whether every executor runs on this machine: a local master, or a standalone
    master on a loopback address (its workers must be here to reach it)."""
    if is_local(master) or master.startswith("local-cluster["):
        return True
    hosts = _master_hosts(master)
    return bool(hosts) and all(is_loopback(h) for h in hosts)


def local_path(location: str) -> str | None:
    """The path of a location on the local file system (a plain path, ``file:/x``,
    ``file:///x`` or ``file://localhost/x``: all the same ``/x``); None for another
    scheme (``hdfs://``, ``s3a://``)."""
    match = _URI.match(location)
    if match is None or len(match["scheme"]) == 1:  # a plain path (or a drive letter)
        return location
    if match["scheme"].lower() != "file":
        return None
    rest = location[match.end():]
    if rest.startswith("//"):
        authority, _, path = rest[2:].partition("/")
        if authority not in ("", "localhost"):
            return None  # file://otherhost/x is not this machine's
        return "/" + path
    return rest


def check_location(master: str, location: str, shared: bool, flag: str) -> None:
    """Refuse a location on this machine's disk for a job whose executors are elsewhere."""
    if is_local(master) or shared:
        return
    path = local_path(location)
    if path is None:
        return
    raise UsageError(
        f"{flag} {location} is a directory on this machine's disk, but the executors of {master} "
        f"read and write it on their own machines (and each would hold a part of it): pass a "
        f"location every machine reaches (hdfs://..., s3a://...), or add --archive-shared if "
        f"{path} is a shared mount (NFS, ...) that this machine and every worker see at that path"
    )


def check_reachable(master: str, *, db_host: str | None, embedded: bool, server: str | None = None) -> None:
    """Refuse loopback addresses the executors would take for their own machine."""
    if on_this_machine(master):
        return
    if embedded:
        raise UsageError(
            f"the embedded PostgreSQL under --data-path listens on 127.0.0.1 only, which the "
            f"executors of {master} cannot reach: run dmq on a PostgreSQL that the workers reach "
            f"and pass --pg-dsn postgresql://USER:PASSWORD@HOST:5432/DB (docs/pipeline.md, "
            f"running on a cluster)"
        )
    if db_host and is_loopback(db_host):
        raise UsageError(
            f"--pg-dsn names {db_host}, which on each executor of {master} is that executor's own "
            f"machine: give PostgreSQL's address as the workers reach it (a name or an address "
            f"they can connect to)"
        )
    if server is not None:
        host = server.rsplit(":", 1)[0] if not server.startswith("[") else server[1:].split("]", 1)[0]
        if is_loopback(host):
            raise UsageError(
                f"--server {server} is a loopback address, which on each executor of {master} is "
                f"that executor's own machine: pass --server HOST:PORT of a dmq server the "
                f"workers reach"
            )


# -- executors ----------------------------------------------------------------------


def _conf_int(conf, key: str) -> int | None:
    value = conf.get(key, None)
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None


def expected_cores(conf) -> int | None:
    """The cores the configuration promises the job, if it says."""
    cores_max = _conf_int(conf, "spark.cores.max")
    if cores_max:
        return cores_max
    instances, per = _conf_int(conf, "spark.executor.instances"), _conf_int(conf, "spark.executor.cores")
    if instances and per:
        return instances * per
    return None


def executor_cores(
    spark,
    progress: Callable[[str], None] = lambda text: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """The job's executor cores on a cluster, once its executors have joined (see the
    module doc); ``spark.default.parallelism``, when set, is taken as it is. With
    dynamic allocation nothing is waited for: ``maxExecutors`` x ``executor.cores``
    when both are set, else Spark's default parallelism."""
    sc = spark.sparkContext
    conf = sc.getConf()
    configured = _conf_int(conf, "spark.default.parallelism")
    if configured:
        return configured
    jsc = sc._jsc.sc()
    if str(conf.get("spark.dynamicAllocation.enabled", "false")).lower() == "true":
        # executors come when tasks wait for them: there is nothing to wait for yet
        most, per = (_conf_int(conf, "spark.dynamicAllocation.maxExecutors"),
                     _conf_int(conf, "spark.executor.cores"))
        return most * per if most and per else jsc.defaultParallelism()
    expected = expected_cores(conf)

    def state() -> tuple[int, int]:
        executors = jsc.getExecutorMemoryStatus().size() - 1  # less the driver
        return executors, (jsc.defaultParallelism() if executors > 0 else 0)

    started = clock()
    executors, cores = state()
    first_at = started if executors else None
    changed_at = started
    said = False
    while True:
        if expected and cores >= expected:
            return cores
        now = clock()
        if first_at is None:
            if now - started >= FIRST_EXECUTOR_S:
                raise JobFailed(
                    f"no executor joined {sc.master} in {FIRST_EXECUTOR_S:.0f} s: are its workers "
                    "running, with free cores and the memory asked for (spark.executor.memory)?"
                )
        elif now - changed_at >= SETTLE_S or now - first_at >= MORE_EXECUTORS_S:
            return max(cores, 1)
        if not said and now - started >= 1.0:
            progress(f"waiting for the executors of {sc.master} ({executors} so far)")
            said = True
        sleep(0.25)
        seen = state()
        if seen != (executors, cores):
            executors, cores = seen
            changed_at = clock()
            if first_at is None and executors:
                first_at = changed_at

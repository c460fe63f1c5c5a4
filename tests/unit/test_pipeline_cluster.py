"""The pipeline's cluster rules, without Spark: locations, loopback, settings, errors,
and the wait for executors on an injected clock."""

from __future__ import annotations

import pytest

from dmq_pipeline import cluster
from dmq_pipeline.archive import dataset_path, normalize_location
from dmq_pipeline.errors import JobFailed
from dmq_pipeline.failures import explain, is_spark_error
from dmq_pipeline.options import SparkOptions
from dmq_pipeline.session import session_settings


@pytest.mark.parametrize("spelling", ["/srv/a", "/srv/a/", "file:/srv/a", "file:///srv/a", "file://localhost/srv/a/"])
def test_a_local_location_has_one_spelling(spelling):
    assert normalize_location(spelling) == "/srv/a"
    assert dataset_path(spelling) == "file:///srv/a/delivery_log"


def test_other_schemes_stay_as_given():
    assert normalize_location("hdfs://nn:8020/dmq/") == "hdfs://nn:8020/dmq"
    assert cluster.local_path("s3a://bucket/dmq") is None
    assert cluster.local_path("file://otherhost/x") is None
    assert dataset_path("s3a://bucket/dmq") == "s3a://bucket/dmq/delivery_log"


@pytest.mark.parametrize("master, here", [
    ("local[*]", True), ("local", True), ("local-cluster[2,1,1024]", True),
    ("spark://127.0.0.1:7077", True), ("spark://localhost:7077", True), ("spark://[::1]:7077", True),
    ("spark://127.0.0.1:7077,10.0.0.2:7077", False), ("spark://master:7077", False),
    ("yarn", False), ("k8s://https://api:6443", False),
])
def test_which_masters_keep_the_executors_on_this_machine(master, here):
    assert cluster.on_this_machine(master) is here


def test_loopback_is_decided_without_looking_names_up():
    assert cluster.is_loopback("127.0.0.2") and cluster.is_loopback("::1") and cluster.is_loopback("localhost")
    assert not cluster.is_loopback("db.internal") and not cluster.is_loopback("10.0.0.5")


def test_a_shared_location_is_allowed_and_a_uri_always():
    cluster.check_location("spark://master:7077", "/mnt/shared/dmq", True, "--archive")
    cluster.check_location("spark://master:7077", "hdfs:///dmq", False, "--archive")
    cluster.check_location("local[4]", "/tmp/dmq", False, "--archive")
    with pytest.raises(cluster.UsageError, match="--archive-shared"):
        cluster.check_location("yarn", "file:///tmp/dmq", False, "--archive")


def test_the_jdbc_jar_is_appended_to_the_users_jars_and_the_environment_to_the_archives():
    opts = SparkOptions(jdbc_jar="/usr/share/java/postgresql.jar",
                        spark_conf=("spark.jars=/opt/a.jar,/opt/b.jar", "spark.archives=/opt/x.zip#x"))
    settings = session_settings(opts, shipped="/cache/env.tar.gz")
    assert settings["spark.jars"] == "/opt/a.jar,/opt/b.jar,/usr/share/java/postgresql.jar"
    assert settings["spark.archives"] == "/opt/x.zip#x,/cache/env.tar.gz#env"
    assert session_settings(SparkOptions(jdbc_jar="/j.jar"))["spark.jars"] == "/j.jar"
    assert "spark.archives" not in session_settings(SparkOptions(jdbc_jar="/j.jar"))


class Py4JJavaError(Exception):
    """Stands for py4j's class (is_spark_error looks at the module)."""


Py4JJavaError.__module__ = "py4j.protocol"

FRAME = "An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.\n"


def test_errors_name_their_cause_and_the_fix():
    cannot_run = Py4JJavaError(
        FRAME + ": org.apache.spark.SparkException: Job aborted due to stage failure: Lost task 0.0: "
        'java.io.IOException: Cannot run program "python3": error=2, No such file or directory\n'
        "\tat java.base/java.lang.ProcessBuilder.start(ProcessBuilder.java:1143)\n"
    )
    assert is_spark_error(cannot_run) and not is_spark_error(ValueError("x"))
    assert explain(cannot_run).startswith("the executors cannot start Python 'python3'")
    assert "--ship-env build" in explain(cannot_run)
    no_module = Py4JJavaError(
        FRAME + "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
        "ModuleNotFoundError: No module named 'dmq_pipeline'\n\tat org.apache.spark...\n"
    )
    assert explain(no_module).startswith("ModuleNotFoundError: No module named 'dmq_pipeline' (raised in a Spark")
    assert "--ship-env build" in explain(no_module)
    refused = Py4JJavaError(
        FRAME + ": org.apache.spark.SparkException: Job aborted\n"
        "Caused by: org.postgresql.util.PSQLException: Connection to db:5432 refused. Check that the "
        "hostname and port are correct\n\tat org.postgresql...\n"
    )
    assert explain(refused).startswith("org.postgresql.util.PSQLException: Connection to db:5432 refused.")
    assert "workers can connect to" in explain(refused)


class FakeJvmContext:
    """What executor_cores reads of SparkContext._jsc.sc(): executors join over time."""

    def __init__(self, clock, joins):
        self.clock, self.joins = clock, joins  # [(at seconds, cores of the executor)]

    def _joined(self):
        return [cores for at, cores in self.joins if at <= self.clock.now]

    def getExecutorMemoryStatus(self):
        size = len(self._joined()) + 1  # and the driver
        return type("Map", (), {"size": lambda _self: size})()

    def defaultParallelism(self):
        return max(sum(self._joined()), 2)


class FakeSpark:
    def __init__(self, clock, joins, conf=None):
        jvm = FakeJvmContext(clock, joins)
        settings = dict(conf or {})
        self.sparkContext = type("Sc", (), {
            "master": "spark://master:7077",
            "_jsc": type("Jsc", (), {"sc": lambda _self: jvm})(),
            "getConf": lambda _self: type("Conf", (), {"get": lambda _s, k, d=None: settings.get(k, d)})(),
        })()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_partitions_wait_for_executors_that_join_late():
    clock = Clock()
    spark = FakeSpark(clock, [(2.0, 2), (2.5, 2), (4.0, 4)])
    assert cluster.executor_cores(spark, clock=clock, sleep=clock.sleep) == 8
    assert clock.now >= 4.0 + cluster.SETTLE_S


def test_partitions_take_the_promised_cores_as_soon_as_they_are_there():
    clock = Clock()
    spark = FakeSpark(clock, [(1.0, 4), (1.5, 4), (30.0, 4)], {"spark.cores.max": "8"})
    assert cluster.executor_cores(spark, clock=clock, sleep=clock.sleep) == 8
    assert clock.now < 2.0
    spark = FakeSpark(clock, [], {"spark.default.parallelism": "12"})
    assert cluster.executor_cores(spark, clock=clock, sleep=clock.sleep) == 12


def test_no_executor_at_all_is_a_clear_failure():
    clock = Clock()
    with pytest.raises(JobFailed, match="no executor joined spark://master:7077 in 60 s"):
        cluster.executor_cores(FakeSpark(clock, []), clock=clock, sleep=clock.sleep)


def test_dynamic_allocation_is_not_waited_for():
    clock = Clock()
    conf = {"spark.dynamicAllocation.enabled": "true", "spark.dynamicAllocation.maxExecutors": "5",
            "spark.executor.cores": "4"}
    assert cluster.executor_cores(FakeSpark(clock, [], conf), clock=clock, sleep=clock.sleep) == 20
    assert clock.now == 0

"""Reading dmq's tables with Spark's JDBC source, in parallel over id ranges.

Every read is a named ``jdbc_*`` query from ``sql/pipeline.sql`` (a
parenthesised, aliased subquery with an ``id`` column), passed as
``dbtable``. Given the id bounds of the rows it selects, the read is split
into ``--partitions`` id ranges that the executors fetch concurrently, each
with its own connection and a server-side cursor (``fetchsize``), so no
executor holds more than one fetch of rows at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .cluster import executor_cores, is_local
from .database import Database
from .options import SparkOptions

__all__ = ["IdRange", "read_query", "partition_count"]


@dataclass(frozen=True)
class IdRange:
    """Ids ``first..last`` inclusive."""

    first: int
    last: int

    @property
    def size(self) -> int:
        return self.last - self.first + 1


def partition_count(spark, opts: SparkOptions) -> int:
    """``--partitions``, else the cores the job has: on a cluster, those of the
    executors once they joined (``cluster.executor_cores``, counted when the session
    started), not the few registered at the moment of asking."""
    if opts.partitions:
        return opts.partitions
    sc = spark.sparkContext
    if is_local(sc.master):
        return sc.defaultParallelism
    cores = getattr(sc, "_dmq_executor_cores", None)
    if cores is None:  # a session the job did not start (a notebook's)
        cores = sc._dmq_executor_cores = executor_cores(spark)
    return cores


def read_query(
    spark,
    db: Database,
    opts: SparkOptions,
    name: str,
    params: dict[str, Any],
    ids: IdRange | None = None,
    partitions: int | None = None,
    column: str = "id",
):
    """A DataFrame over the rows of query ``name``; partitioned on ``column`` over
    ``ids`` when they are given."""
    reader = (
        spark.read.format("jdbc")
        .option("url", db.jdbc_url)
        .option("dbtable", db.render(name, **params))
        .option("fetchsize", str(opts.fetch_size))
    )
    for key, value in db.jdbc_properties.items():
        reader = reader.option(key, value)
    count = partitions or partition_count(spark, opts)
    if ids is not None and count > 1 and ids.size > 1:
        reader = (
            reader.option("partitionColumn", column)
            .option("lowerBound", str(ids.first))
            .option("upperBound", str(ids.last + 1))
            .option("numPartitions", str(min(count, ids.size)))
        )
    return reader.load()

"""dmq's data pipeline on PySpark: ``dmq-pipeline archive | report | replay``.

* ``archive`` (:mod:`.archive`): delivery-log rows and their messages to Parquet,
  partitioned by topic and day, then trimmed from PostgreSQL; batched,
  idempotent and resumable.
* ``report`` (:mod:`.report`, :mod:`.report_output`, :mod:`.charts`):
  throughput, latency percentiles, attempts, backlog and dead letters per
  topic and channel, as Parquet/CSV tables, PNG charts and an HTML page.
* ``replay`` (:mod:`.replay`): dead letters republished from the executors
  through a dmq server as reliable sends, each once.

Reads go through Spark's JDBC source (:mod:`.jdbc`) with partitioned reads over
id ranges; :mod:`.database` is the only psycopg user, :mod:`.options` holds
every setting, :mod:`.cli` is the ``dmq-pipeline`` command. On a cluster,
:mod:`.cluster` refuses what its executors cannot use before Spark starts,
:mod:`.ship` ships them dmq's Python (``--ship-env``) and :mod:`.failures` turns
a failed job into its cause. Installed with the ``pipeline`` extra of
``dmq-server``; ``docs/pipeline.md`` is the guide.
"""

__all__: list[str] = []

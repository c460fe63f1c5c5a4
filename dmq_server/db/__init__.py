"""The database seam: the only package of the server that imports psycopg and runs SQL.

Work is written as steps (``steps.py``: generators yielding ``Statement``s that name
their query in ``sql/queries.sql``), run by a worker thread (``worker.py``), by the
reactor-driven connection (``reactor.py``) or over a blocking connection
(``steps.run_steps``: the CLI); unit tests run the same steps on the in-memory double
(``memory.py``), which answers every statement but the migrator's. The statements live
in modules named for what they store: ``messages`` (sends, deliveries, acks, backlog),
``delays``, ``dead_letters``, ``topics`` (and the registry's mirror), ``takeover``,
``trace``, ``admin``, ``clusters`` and ``schema`` (and the health check).
Failures leave as ``errors.StorageError``. The private PostgreSQL (``embedded.py``)
and its supervisor live here too.
"""

"""The database seam: the only package of the server that imports psycopg and runs SQL.

Work is written as steps (``steps.py``: generators yielding ``Statement``s that name
their query in ``sql/queries.sql``) or as functions of a connection, run by a worker
thread (``worker.py``) or by the reactor-driven connection (``reactor.py``); unit
tests run the same steps on the in-memory double (``memory.py``). The statements
live in modules named for what they store: ``messages`` (sends, deliveries, acks,
backlog), ``delays``, ``dead_letters``, ``topics``, ``takeover`` and ``admin``.
Failures leave as ``errors.StorageError``. The private PostgreSQL (``embedded.py``)
and its supervisor live here too.
"""

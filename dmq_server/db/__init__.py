"""The database seam: the only package of the server that imports psycopg and runs SQL.

Work is written as steps (``steps.py``) or as functions of a connection, run by a
worker thread (``worker.py``) or by the reactor-driven connection (``reactor.py``).
Failures leave as ``errors.StorageError``. The private PostgreSQL (``embedded.py``)
and its supervisor live here too.
"""

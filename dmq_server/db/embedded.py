"""The private PostgreSQL under the data directory, as the server reaches it.

The server itself lives in ``dmq_sql.embedded`` (psycopg and the standard library
only), shared with the pipeline so that neither imports the other; the server
takes it through its database seam, the only package that may load ``dmq_sql``.
"""

from __future__ import annotations

from dmq_sql.embedded import EmbeddedPostgres, EmbeddedPostgresError

__all__ = ["EmbeddedPostgres", "EmbeddedPostgresError"]

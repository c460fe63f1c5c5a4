"""What a database failure means to the caller: refused (known not committed) or unknown.

Every failure leaves ``dmq_server.db`` as a ``StorageError``, so callers above the
seam never catch psycopg's classes; the subclass tells whether retrying can help.
"""

from __future__ import annotations

import psycopg

from dmq_server.core.errors import Unavailable
from dmq_sql.connection import describe_error

__all__ = ["StorageError", "RefusedError", "Fenced", "Misplaced", "storage_error", "describe_error"]


class StorageError(Unavailable):
    """PostgreSQL could not do what was asked; the message says what failed.

    Unless it is a ``RefusedError``, the outcome is *unknown*: a connection that
    broke after a statement was sent may have committed it (the answer was lost),
    so whoever wrote must find out from the store what is there.
    """

    code = "E_STORAGE"
    # the PostgreSQL backend that ran the failed statement, when known: a write whose
    # answer was lost is settled once that backend is gone (``reliable.horizon``)
    backend_pid: int | None = None


class RefusedError(StorageError):
    """PostgreSQL answered the statement with an error about its input (a data
    exception, a constraint, a limit): nothing of it was committed, and running the
    same input again fails the same way, so a batch that held it is split to find
    the rows at fault (see ``writer.GroupCommitWriter``)."""

    def __init__(self, message: str, sqlstate: str):
        super().__init__(message)
        self.sqlstate = sqlstate



class Fenced(StorageError):
    """This server's incarnation was retired (migration 0007's ``dmq_owner``): another
    node presumed it dead and took its messages over, or another server started on the
    same database without ZooKeeper. Nothing was stored (a known outcome, not the
    input's fault), and nothing will be until this server starts again."""

    code = "E_FENCED"


class Misplaced(StorageError):
    """The send's topic is not placed on this database's cluster (it was moved: the
    sender's view of the registry was stale). Nothing was stored (a known outcome); a
    retry goes to the topic's cluster once the registry is read again."""

    code = "E_MOVED"


# SQLSTATE classes that blame the statement's input, not the server or the link:
# 22 data exception, 23 integrity constraint, 54 program limit exceeded.
_INPUT_ERROR_CLASSES = ("22", "23", "54")


def storage_error(where: str, exc: BaseException) -> StorageError:
    """The StorageError for ``exc`` raised at ``where``: a RefusedError when the
    server answered with an input error (so the outcome is known: not committed)."""
    sqlstate = getattr(exc, "sqlstate", None)
    text = f"{where}: {describe_error(exc)}"
    if isinstance(exc, psycopg.Error) and sqlstate and sqlstate[:2] in _INPUT_ERROR_CLASSES:
        return RefusedError(text, sqlstate)
    return StorageError(text)

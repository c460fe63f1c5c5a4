"""The outbox schema in an *application's* database: install, uninstall, prune its inbox.

Not dmq's own database: ``dmq outbox install --dsn APP_DSN`` creates a schema (default
``dmq_outbox``) beside the application's tables, so its transactions can send messages
(the outbox) and record what they consumed (the inbox) in the same commit as their own
writes. The SQL is in ``sql/outbox/`` (``NNNN_desc.sql`` migrations with ``@schema@`` and
``@channel@`` in place of the schema's name, and ``queries.sql``); this module fills in
the name, applies what is missing in one transaction and records each version in the
schema's own ``schema_version`` table, as ``dmq_sql.schema`` does for dmq's database.
Failures leave as ``StorageError``; a refused request (a schema that is not an outbox's,
unrelayed rows in the way) as ``Refused``/``Invalid`` with the reason.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import resources
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from dmq_server.core.errors import Invalid, Refused
from dmq_server.core.outbox_figures import Measured
from dmq_server.core.outbox_rows import OutboxRow, check_tag, outbox_row
from dmq_server.db.arrays import Int8Array
from dmq_server.db.storage_errors import StorageError, describe_error
from dmq_server.db.worker import connect
from dmq_sql import load_queries

__all__ = ["DEFAULT_SCHEMA", "GRANTS", "RELAY_MIN_VERSION", "check_schema", "grants_for", "install", "uninstall", "retag", "check_installed",
           "prune_inbox", "migrations", "relay_queries", "hold_relay", "read_tag", "read_rows", "wait_for_rows",
           "delete_rows", "delete_and_read", "present_rows", "release_relay",
           "read_figures", "named_dsn", "dsn_database"]

DEFAULT_SCHEMA = "dmq_outbox"

#: what an application role needs, and nothing more: add messages and inbox records in its
#: own transactions; never read, change or delete the outbox
GRANTS = (
    "GRANT USAGE ON SCHEMA {schema} TO {role};",
    "GRANT EXECUTE ON FUNCTION {schema}.send(text, bytea, bigint, bigint, text, integer, jsonb),"
    " {schema}.send(text, text, bigint, bigint, text, integer, jsonb) TO {role};",
    "GRANT INSERT ON {schema}.outbox TO {role};",
    "GRANT INSERT, SELECT ON {schema}.inbox TO {role};",
)

#: the oldest outbox version a relay reads: 2 gave the install its tag (the producer its
#: rows go as); version 3's properties live in a column every version has
#: (sql/outbox/0003_properties.sql), so an outbox not brought up to date relays as before
RELAY_MIN_VERSION = 2

# lower case only: the name is both an identifier and the relay's NOTIFY channel, unquoted
_SCHEMA = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_MIGRATION = re.compile(r"^(?P<version>\d{4})_(?P<desc>[a-z0-9_]+)\.sql$")


def check_schema(schema: str) -> str:
    if not _SCHEMA.fullmatch(schema or ""):
        raise Invalid(f"invalid schema name {schema!r}: use 1-63 characters from [a-z0-9_], not starting with a digit")
    return schema


def grants_for(schema: str, role: str = "APP_ROLE") -> list[str]:
    """The GRANT statements an application role needs, for ``schema``."""
    return [line.format(schema=check_schema(schema), role=role) for line in GRANTS]


def _folder():
    return resources.files("dmq_sql").joinpath("outbox")


def _fill(sql: str, schema: str) -> str:
    return sql.replace("@schema@", schema).replace("@channel@", f"'{schema}'")


def migrations(schema: str = DEFAULT_SCHEMA) -> list[tuple[int, str, str]]:
    """``[(version, description, sql)]`` in version order, for ``schema``."""
    check_schema(schema)
    found = []
    for entry in _folder().iterdir():
        match = _MIGRATION.match(entry.name)
        if match:
            found.append((int(match["version"]), match["desc"], _fill(entry.read_text(encoding="utf-8"), schema)))
    found.sort()
    versions = [v for v, _, _ in found]
    if versions != list(range(1, len(versions) + 1)):
        raise RuntimeError(f"outbox migrations must be numbered 1..N without gaps, found {versions}")
    return found


def _queries(schema: str) -> dict[str, str]:
    text = _folder().joinpath("queries.sql").read_text(encoding="utf-8")
    return {name: _fill(sql, schema) for name, sql in load_queries(text).items()}


@contextmanager
def _database(dsn: str, what: str) -> Iterator[psycopg.Connection]:
    with connect(dsn) as conn:
        try:
            yield conn
        except psycopg.Error as exc:
            raise StorageError(f"{what} failed: {describe_error(exc)}") from exc


def _one(cur: psycopg.Cursor) -> tuple[Any, ...]:
    """The row of a statement that always returns one (a count, the schema's state)."""
    row = cur.fetchone()
    if row is None:
        raise StorageError("the outbox statement returned no row")
    return row


def _state(conn: psycopg.Connection, q: dict[str, str], schema: str) -> tuple[bool, bool]:
    exists, ours = _one(conn.execute(q["schema_state"], {"schema": schema}))
    return exists, ours


def install(dsn: str, schema: str = DEFAULT_SCHEMA) -> tuple[list[int], int]:
    """Create or bring up to date the outbox schema; returns (versions applied now, the
    version it is at). Installing again applies nothing. An existing schema of that name
    that is not an outbox's is refused, never written into."""
    q = _queries(check_schema(schema))
    applied: list[int] = []
    with _database(dsn, "outbox install") as conn, conn.transaction():
        conn.execute(q["lock_install"], {"schema": schema})
        exists, ours = _state(conn, q, schema)
        if exists and not ours:
            raise Refused(f"schema {schema} exists and is not a dmq outbox (no {schema}.schema_version): "
                          "choose another --schema")
        conn.execute(q["create_schema"])
        conn.execute(q["create_version_table"])
        done = {row[0] for row in conn.execute(q["installed_versions"])}
        for version, description, sql in migrations(schema):
            if version not in done:
                conn.execute(sql)
                conn.execute(q["record_version"], {"version": version, "description": description})
                applied.append(version)
                done.add(version)
    return applied, max(done)


def check_installed(dsn: str, schema: str = DEFAULT_SCHEMA) -> int:
    """The version the outbox ``schema`` is at in the application database at ``dsn``,
    when a relay reads it (``RELAY_MIN_VERSION`` or later: the install's tag is version 2);
    Refused saying what to run when it is missing or older (``dmq outbox attach`` asks
    before it records an outbox: a relay of a missing one would only fail, every second)."""
    q = _queries(check_schema(schema))
    with _database(dsn, "outbox check") as conn:
        exists, ours = _state(conn, q, schema)
        if not ours:
            what = "is not a dmq outbox" if exists else "is not installed"
            raise Refused(f"outbox schema {schema} {what} in that database: "
                          f"run `dmq outbox install --dsn APP_DSN --schema {schema}` first")
        versions = [row[0] for row in conn.execute(q["installed_versions"])]
    version = max(versions, default=0)
    if version < RELAY_MIN_VERSION:
        raise Refused(f"outbox schema {schema} is at version {version}, this dmq relays version "
                      f"{RELAY_MIN_VERSION} or later: "
                      f"run `dmq outbox install --dsn APP_DSN --schema {schema}` to bring it up to date")
    return version


def uninstall(dsn: str, schema: str = DEFAULT_SCHEMA, *, force: bool = False) -> int:
    """Drop the outbox schema (its inbox records with it); returns the outbox rows dropped.
    Refused while rows wait to be relayed, unless ``force``: they would be lost. A schema
    that is not an outbox's is refused; one that is not there is not an error."""
    q = _queries(check_schema(schema))
    with _database(dsn, "outbox uninstall") as conn, conn.transaction():
        conn.execute(q["lock_install"], {"schema": schema})
        exists, ours = _state(conn, q, schema)
        if not exists:
            return 0
        if not ours:
            raise Refused(f"schema {schema} is not a dmq outbox (no {schema}.schema_version): not dropped")
        pending = _one(conn.execute(q["pending_count"]))[0]
        if pending and not force:
            raise Refused(f"{pending} message(s) in {schema}.outbox are not relayed yet and would be lost: "
                          "relay them first, or uninstall with --force")
        conn.execute(q["drop_schema"])
        return pending


def retag(dsn: str, schema: str = DEFAULT_SCHEMA) -> tuple[str, str]:
    """Give the install a new tag (``core.outbox_rows``): rows numbered from now on are
    stored as another producer than every row relayed before, so an id used again (the
    application's database restored from a backup, the outbox's identity restarted) is
    never taken for a repeat. Rows still in the outbox go under the new tag too: one the
    relay stored before (then restored) is stored again. Returns (old tag, new tag)."""
    q = _queries(check_schema(schema))
    with _database(dsn, "outbox retag") as conn, conn.transaction():
        conn.execute(q["lock_install"], {"schema": schema})
        exists, ours = _state(conn, q, schema)
        if not ours:
            raise Refused(f"schema {schema} is not a dmq outbox" if exists else f"no outbox schema {schema} here")
        try:
            new, old = _one(conn.execute(q["retag"]))
        except psycopg.errors.UndefinedTable:
            raise Refused(f"outbox {schema} is at version 1 (it has no tag): "
                          "run `dmq outbox install` to bring it up to date") from None
        return old, new


def prune_inbox(dsn: str, older_than_s: float, schema: str = DEFAULT_SCHEMA, *, batch: int = 10000) -> int:
    """Delete inbox records processed more than ``older_than_s`` seconds ago, ``batch`` at
    a time, each batch committed on its own (short transactions, few locks); returns how
    many went."""
    if older_than_s <= 0:
        raise Invalid(f"older than must be positive, got {older_than_s}s")
    if batch < 1:
        raise Invalid(f"batch must be 1 or more, got {batch}")
    q = _queries(check_schema(schema))
    removed = 0
    with _database(dsn, "inbox prune") as conn:
        conn.autocommit = True
        while True:
            count = _one(conn.execute(q["prune_inbox"], {"older_than_s": older_than_s, "batch": batch}))[0]
            removed += count
            if count < batch:
                return removed


# -- the relay's side (dmq_server.protocols.outbox_relay): each runs on the relay's worker
# thread (db.worker.DbWorker, autocommit) with its one connection to the application's
# database, and takes the statements of ``relay_queries``.

def relay_queries(schema: str) -> dict[str, str]:
    """The outbox's statements with ``schema`` filled in (checked)."""
    return _queries(check_schema(schema))


def hold_relay(conn: psycopg.Connection, q: dict[str, str], schema: str, locked_pid: int) -> int:
    """This connection's backend pid if it holds the outbox's relay lock, else 0. The
    lock is the session's: ``locked_pid`` is the backend that took it, and a worker that
    reconnected (another pid) has lost it and must take it again, then LISTEN again."""
    pid = conn.info.backend_pid
    if pid == locked_pid:
        return pid
    if not _one(conn.execute(q["relay_lock"], {"schema": schema}))[0]:
        return 0
    conn.execute(q["relay_listen"])
    return pid


def read_tag(conn: psycopg.Connection, q: dict[str, str], schema: str) -> str:
    """The install's tag (``core.outbox_rows``: the producer its numbered rows go as)."""
    try:
        return check_tag(schema, _one(conn.execute(q["relay_tag"]))[0])
    except psycopg.errors.UndefinedTable as exc:
        raise StorageError(_not_installed(schema, exc)) from exc


def read_rows(conn: psycopg.Connection, q: dict[str, str], schema: str, limit: int,
              after: int = 0, exclude: Sequence[int] = ()) -> tuple[str, list[OutboxRow]]:
    """The next ``limit`` committed rows with an id above ``after`` and not in ``exclude``
    (the batch being stored while this reads ahead), in id order, and the tag of the
    install they belong to (read with them: "" when there are none). The NOTIFYs received
    so far go first: this read sees every row they announce, and psycopg keeps those that
    arrive while other statements run until ``notifies`` takes them, which under a steady
    load (rows every cycle, never a wait) would be never: memory without bound."""
    for _ in conn.notifies(timeout=0):
        pass
    try:
        if exclude:
            found = conn.execute(q["relay_read_past"], {"limit": limit, "after": after,
                                                        "exclude": Int8Array(exclude)}).fetchall()
        else:
            found = conn.execute(q["relay_read"], {"limit": limit, "after": after}).fetchall()
    except psycopg.errors.UndefinedTable as exc:
        raise StorageError(_not_installed(schema, exc)) from exc
    if not found:
        return "", []
    return check_tag(schema, found[0][6]), [outbox_row(row[0], row[1], bytes(row[2]), row[3], row[4], row[5], row[7])
                                            for row in found]


def _not_installed(schema: str, exc: psycopg.Error) -> str:
    return (f"{describe_error(exc)}: run `dmq outbox install --schema {schema}` on the application's database "
            "(an outbox installed before version 2 has no installation table, and gets it then)")


def release_relay(conn: psycopg.Connection) -> None:
    """End the session: the relay lock and the LISTEN go with it (a relay giving the
    outbox up to the node ZooKeeper placed it on; the worker connects again when asked)."""
    conn.close()


def wait_for_rows(conn: psycopg.Connection, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the outbox's NOTIFY (``hold_relay`` listens);
    True if one came (the relay reads the table: the payload is a hint only)."""
    for _ in conn.notifies(timeout=timeout, stop_after=1):
        return True
    return False


def delete_rows(conn: psycopg.Connection, q: dict[str, str], ids: list[int]) -> int:
    """Remove rows dmq stored (or recorded as dead letters); returns how many went."""
    return conn.execute(q["relay_delete"], {"ids": Int8Array(ids)}).rowcount


def delete_and_read(conn: psycopg.Connection, q: dict[str, str], schema: str, locked_pid: int, ids: list[int],
                    limit: int, after: int = 0, exclude: Sequence[int] = ()) -> tuple[str, list[OutboxRow]]:
    """``delete_rows`` of ``ids``, then ``read_rows``: the relay's one call to the
    application's database a batch. Only on the connection that holds the relay's lock
    (backend ``locked_pid``): a worker that reconnected has lost it, and a delete
    committed without the lock could let the relay's ledger forget rows another relay
    has read meanwhile (StorageError, nothing done). ``limit`` 0 deletes only."""
    if conn.info.backend_pid != locked_pid:
        raise StorageError(f"outbox {schema}: the connection holding the relay's lock ended "
                           "(the next cycle takes it again, or another node relays)")
    if ids:
        delete_rows(conn, q, ids)
    if not limit:
        return "", []
    return read_rows(conn, q, schema, limit, after, exclude)


def present_rows(conn: psycopg.Connection, q: dict[str, str], ids: list[int]) -> set[int]:
    """Which of ``ids`` are still in the outbox."""
    return {row[0] for row in conn.execute(q["relay_present"], {"ids": ids})}


def read_figures(conn: psycopg.Connection, q: dict[str, str], schema: str, bound: int) -> Measured:
    """The outbox's figures for operators (``core.outbox_figures``): pending rows up to
    ``bound``, the oldest one's age, the lock holder's ``application_name``."""
    pending, oldest, holder = _one(conn.execute(q["relay_figures"], {"bound": bound, "schema": schema}))
    return Measured(pending, oldest, holder)


def named_dsn(dsn: str, application_name: str) -> str:
    """``dsn`` with its sessions' ``application_name`` set (a relay names its node, so
    ``read_figures`` on any node can tell who holds the lock)."""
    return make_conninfo(dsn, application_name=application_name)


def dsn_database(dsn: str) -> str:
    """``host/dbname`` of a DSN (URL or ``key=value``), for operators: never the password
    or the rest of it. An unparsable DSN gives ``?``."""
    try:
        parts = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "?"
    host = str(parts.get("host") or parts.get("hostaddr") or "local")
    port = parts.get("port")
    where = f"{host}:{port}" if port else host
    return f"{where}/{parts.get('dbname') or parts.get('user') or '?'}"

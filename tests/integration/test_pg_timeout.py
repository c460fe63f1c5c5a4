"""A PostgreSQL that stops answering without closing its connections (paused, hung, a
link that swallows packets the kernel already acknowledged) fails the statement after
``--pg-timeout`` as an unknown outcome, and the next statement connects again: neither
a DbWorker thread nor the reactor's connection waits for ever."""

from __future__ import annotations

import time

import pytest

from dmq_server.db.storage_errors import StorageError
from dmq_server.db.reactor import ReactorDb
from dmq_server.db.worker import DbWorker
from tests.chaos.faultproxy import FaultProxy

from .test_reactor_db import _stmt, on_reactor

SELECT = "SELECT 41 + 1"


@pytest.fixture
def proxy(pg_dsn):
    import psycopg

    info = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    fault = FaultProxy({"pg": (str(info.get("host") or "127.0.0.1"), int(info["port"]))})
    info.update(host="127.0.0.1", port=str(fault.ports["pg"]), sslmode="disable")
    fault.dsn = psycopg.conninfo.make_conninfo(**info)
    yield fault
    fault.close()


def _select(conn):
    return conn.execute(SELECT).fetchone()[0]


def _select_steps():
    rows = yield _stmt(SELECT, {})
    return rows[0][0]


def _worker(reactor, dsn):
    worker = DbWorker(reactor, dsn, "probe", timeout=1.0)
    return worker, lambda: worker.run(_select)


def _reactor_db(reactor, dsn):
    db = ReactorDb(reactor, dsn, "probe", timeout=1.0)
    return db, lambda: db.run_steps(_select_steps)


@pytest.mark.parametrize("make", [_worker, _reactor_db], ids=["DbWorker", "ReactorDb"])
def test_a_statement_unanswered_past_the_timeout_fails_and_the_next_one_reconnects(proxy, make):
    async def scenario(reactor):
        db, select = make(reactor, proxy.dsn)
        db.start()
        try:
            assert await select() == 42
            proxy.set("pg", "blackhole")
            started = time.monotonic()
            with pytest.raises(StorageError, match="no answer from PostgreSQL in 1s"):
                await select()
            waited = time.monotonic() - started
            proxy.set("pg", "pass")
            assert await select() == 42  # on a new connection
            return waited
        finally:
            db.stop()

    waited = on_reactor(scenario)
    assert 0.9 < waited < 5


def test_a_run_gets_its_whole_timeout_from_a_timer_an_earlier_run_armed(proxy):
    """The reactor's connection keeps one deadline timer across runs: armed by a quick
    run, it fires 0.4 s into a later one that hangs, and waits on for that run's own
    deadline instead of failing it early."""
    from twisted.internet.task import deferLater

    async def scenario(reactor):
        db, select = _reactor_db(reactor, proxy.dsn)
        db.start()
        try:
            assert await select() == 42  # the timer fires 1 s after this run started
            await deferLater(reactor, 0.6)
            proxy.set("pg", "blackhole")
            started = time.monotonic()
            with pytest.raises(StorageError, match="no answer from PostgreSQL in 1s"):
                await select()
            return time.monotonic() - started
        finally:
            db.stop()

    waited = on_reactor(scenario)
    assert 0.9 < waited < 5

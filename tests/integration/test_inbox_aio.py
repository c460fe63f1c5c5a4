"""dmq_client.inbox.atransaction: the inbox for asyncio, on psycopg's AsyncConnection end to
end with the asyncio client and a real dmq-server, and on SQLAlchemy's AsyncSession and
AsyncConnection; the business table counted."""

from __future__ import annotations

import asyncio
from collections import Counter

import psycopg
import pytest

from dmq_client import Message, Status, inbox
from dmq_client.aio import Client

from .support import db_rows
from .test_client import fast_config
from .test_client_aio_confirm import no_pending
from .test_inbox import app_dsn, push  # noqa: F401  (app_dsn: the fixture)

pytestmark = pytest.mark.integration


def test_a_failing_handler_and_a_lost_ack_leave_each_effect_once(make_server, topic, pg_dsn, app_dsn):  # noqa: F811
    """Ten messages consumed with ``async with inbox.atransaction(aconn, message)``. One
    handler fails once: its writes and record roll back, it is not acked, the consumer
    requeues it and its redelivery is handled. One commits and its ack is lost (``ack=``
    does nothing) and the consumer goes away: the next consumer is handed it again and
    gets fresh=False, skips the handler, and the ack goes. Every message has exactly one
    business row, one inbox record, and nothing is left pending at dmq."""
    server = make_server()
    count = 10
    seen: Counter[tuple[str, bool]] = Counter()
    failed: list[str] = []

    async def consume(client: Client, aconn: psycopg.AsyncConnection, done) -> None:
        async for message in client.subscribe(topic, "billing", credit=count):
            body = message.body.decode()
            lose_ack = body == "m3" and message.attempts == 1
            try:
                async with inbox.atransaction(aconn, message, ack=(lambda m: None) if lose_ack else None) as fresh:
                    seen[(body, fresh)] += 1
                    if fresh:
                        await aconn.execute("INSERT INTO effects VALUES (%s, %s)", (message.message_id, message.body))
                        if body == "m5" and not failed:
                            failed.append(body)
                            raise RuntimeError("the charge failed")
            except RuntimeError:
                await message.requeue(delay=0)
            if done():
                return

    async def run():
        async with await psycopg.AsyncConnection.connect(app_dsn) as aconn:
            async with Client(fast_config(server)) as client:
                results = await asyncio.gather(*(client.send(Message(topic, f"m{i}")) for i in range(count)))
                assert {r.status for r in results} == {Status.SUCCESS}
                await consume(client, aconn, lambda: sum(n for (_, fresh), n in seen.items() if fresh) == count + 1)
            # the consumer that lost m3's ack is gone: the server hands m3 out again
            async with Client(fast_config(server)) as client:
                await consume(client, aconn, lambda: seen[("m3", False)] == 1)

    asyncio.run(run())
    assert failed == ["m5"]
    assert seen[("m5", True)] == 2 and seen[("m3", True)] == 1 and seen[("m3", False)] == 1
    assert sum(n for (_, fresh), n in seen.items() if not fresh) == 1
    assert db_rows(app_dsn, "SELECT body, count(*) FROM effects GROUP BY body ORDER BY body") == [
        (f"m{i}".encode(), 1) for i in range(count)
    ]
    assert db_rows(app_dsn, "SELECT count(*) FROM dmq_outbox.inbox") == [(count,)]
    no_pending(pg_dsn)


@pytest.mark.parametrize("kind", ["AsyncSession", "AsyncConnection"])
def test_sqlalchemy_async_session_and_connection(app_dsn, kind):  # noqa: F811
    """The same with SQLAlchemy's asyncio: handled once, a committed redelivery skipped, a
    raise rolled back with its record and not acked; an awaitable ack awaited after the
    commit; one already in a transaction, or a synchronous connection, refused."""
    import sqlalchemy
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    acked: list = []

    async def ack(message) -> None:  # the asyncio client's ack is awaited: so is this one
        acked.append((message.message_id, db_rows(app_dsn, "SELECT count(*) FROM effects")[0][0]))

    async def run() -> None:
        engine = create_async_engine(app_dsn.replace("postgresql://", "postgresql+psycopg://", 1))

        async def handle(conn, message_id: int, fail: bool = False) -> bool:
            async with inbox.atransaction(conn, push(message_id), ack=ack) as fresh:
                if fresh:
                    await conn.execute(sqlalchemy.text("INSERT INTO effects VALUES (:id, 'x')"), {"id": message_id})
                if fail:
                    raise RuntimeError("handler failed")
            return fresh

        try:
            async with (AsyncSession(engine) if kind == "AsyncSession" else engine.connect()) as conn:
                assert await handle(conn, 1) is True
                assert await handle(conn, 1) is False
                with pytest.raises(RuntimeError):
                    await handle(conn, 2, fail=True)
                assert await handle(conn, 2) is True
                await conn.execute(sqlalchemy.text("SELECT 1"))  # autobegins
                with pytest.raises(ValueError, match="begins the transaction itself"):
                    await handle(conn, 3)
                await conn.rollback()
        finally:
            await engine.dispose()

    asyncio.run(run())
    assert acked == [(1, 1), (1, 1), (2, 2)], "an ack came before its commit, or for a rolled-back handler"
    assert db_rows(app_dsn, "SELECT message_id FROM dmq_outbox.inbox ORDER BY 1") == [("1",), ("2",)]
    with psycopg.connect(app_dsn) as conn:
        with pytest.raises(TypeError, match="not asynchronous"):
            asyncio.run(inbox.atransaction(conn, push(4), ack=print).__aenter__())

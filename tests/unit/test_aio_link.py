"""``ServerLink.write``: the bytes of one loop turn go to the connection as one write, and
bytes kept for a connection that was replaced before the turn ended go nowhere."""

from __future__ import annotations

import asyncio

from dmq_client.aio.link import ServerLink
from dmq_client.config import MqConfig


class Writer:
    """The part of ``asyncio.StreamWriter`` the link writes through."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing

    async def drain(self) -> None:
        pass


def _link() -> ServerLink:
    return ServerLink("127.0.0.1:4150", MqConfig(), owner=None)  # type: ignore[arg-type]


def test_the_writes_of_one_turn_are_one_write_at_its_end():
    async def run() -> list[list[bytes]]:
        link, writer = _link(), Writer()
        link._writer = writer  # type: ignore[assignment]
        assert all(link.write(b"frame %d;" % i) for i in range(5))
        during = list(writer.writes)
        await asyncio.sleep(0)  # the turn ends
        after_turn = list(writer.writes)
        link.write(b"next turn")
        await link.drain()  # handed over before the wait, without waiting for the turn's end
        return [during, after_turn, writer.writes]

    during, after_turn, final = asyncio.run(run())
    assert during == []
    assert after_turn == [b"frame 0;frame 1;frame 2;frame 3;frame 4;"]
    assert final == after_turn + [b"next turn"]


def test_bytes_kept_for_a_replaced_or_closing_connection_are_not_written():
    async def run() -> tuple[Writer, Writer, Writer]:
        link, old, new = _link(), Writer(), Writer()
        link._writer = old  # type: ignore[assignment]
        link.write(b"for the old connection")
        link._writer = new  # type: ignore[assignment]  # lost and connected again within the turn
        link.write(b"for the new one")
        await asyncio.sleep(0)
        closing = Writer()
        link._writer = closing  # type: ignore[assignment]
        link.write(b"too late")
        closing.closing = True
        await asyncio.sleep(0)
        return old, new, closing

    old, new, closing = asyncio.run(run())
    assert old.writes == [] and new.writes == [b"for the new one"] and closing.writes == []

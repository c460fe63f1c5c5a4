"""Topic routing over server connections: stable, usable-only, minimal movement."""

from __future__ import annotations

import threading

from dmq_client.connection import ConnState
from dmq_client.routing import ServerPool


class Conn:
    """Stands in for a ServerConnection: routing reads only ``name`` and ``state``."""

    def __init__(self, name: str, state: ConnState = ConnState.READY):
        self.name = name
        self.state = state


def pool_of(*conns: Conn) -> ServerPool:
    pool = ServerPool()
    for conn in conns:
        pool.add(conn)  # type: ignore[arg-type]
    return pool


TOPICS = [f"topic-{i}" for i in range(200)]


def test_a_topic_stays_on_one_server_and_topics_spread_out():
    """A topic always maps to the same server (order on one connection); topics use every server."""
    a, b, c = Conn("a:1"), Conn("b:1"), Conn("c:1")
    pool = pool_of(a, b, c)
    first = {t: pool.pick(t).name for t in TOPICS}
    assert first == {t: pool.pick(t).name for t in TOPICS}
    assert set(first.values()) == {"a:1", "b:1", "c:1"}


def test_only_the_failed_servers_topics_move_and_they_come_back():
    """A rebooting server's topics move elsewhere, the others stay put, and all return with it."""
    a, b, c = Conn("a:1"), Conn("b:1"), Conn("c:1")
    pool = pool_of(a, b, c)
    before = {t: pool.pick(t).name for t in TOPICS}
    b.state = ConnState.REBOOTING
    pool.changed()
    during = {t: pool.pick(t).name for t in TOPICS}
    assert all(during[t] == before[t] for t in TOPICS if before[t] != "b:1")
    assert "b:1" not in during.values()
    b.state = ConnState.READY
    pool.changed()
    assert {t: pool.pick(t).name for t in TOPICS} == before


def test_unhealthy_is_a_last_resort_and_disconnected_never():
    """An unhealthy server is used only with no healthy one; a disconnected or rebooting one never."""
    sick, down = Conn("s:1", ConnState.UNHEALTHY), Conn("d:1", ConnState.DISCONNECTED)
    pool = pool_of(sick, down)
    assert pool.pick("t").name == "s:1"
    sick.state = ConnState.REBOOTING
    pool.changed()
    assert pool.pick("t") is None


def test_exclude_skips_a_server():
    """Failover can ask for a server other than the failed one."""
    a, b = Conn("a:1"), Conn("b:1")
    pool = pool_of(a, b)
    home = pool.pick("t").name
    assert pool.pick("t", exclude=(home,)).name != home


def test_wait_pick_wakes_when_a_server_becomes_ready():
    """A send waiting for a server is woken by the state change, not by polling."""
    a = Conn("a:1", ConnState.CONNECTING)
    pool = pool_of(a)
    assert pool.wait_pick("t", timeout=0) is None
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.wait_pick("t", timeout=10)))
    waiter.start()
    a.state = ConnState.READY
    pool.changed()
    waiter.join(10)
    assert got == [a]


def test_wait_pick_gives_up_when_the_pool_closes():
    """Closing the client releases a send runner waiting for a server at once."""
    pool = pool_of(Conn("a:1", ConnState.DISCONNECTED))
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.wait_pick("t", timeout=30)))
    waiter.start()
    pool.close()
    waiter.join(10)
    assert got == [None]

"""Session ids: unique, monotonic, and never repeated after a restart."""

from __future__ import annotations

import os
import threading

from dmq_client.session import SESSION_ID_MAX, SessionIdGenerator, default_producer_id


class WallClock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_ids_increase_even_when_the_wall_clock_steps_back():
    """A wall clock stepping back (NTP) never makes ids repeat or decrease."""
    clock = WallClock(1_700_000_000.0)
    ids = SessionIdGenerator(clock)
    first = [ids() for _ in range(3)]
    clock.now -= 3600  # NTP step backwards
    later = [ids() for _ in range(3)]
    sequence = first + later
    assert sequence == sorted(sequence) and len(set(sequence)) == 6


def test_a_restarted_producer_starts_above_its_previous_ids():
    """Ids come from the clock, so a new process (a new generator) a millisecond later
    starts above everything the old one handed out at up to a million ids a millisecond."""
    old = SessionIdGenerator(WallClock(1_700_000_000.000))
    last_old = [old() for _ in range(100_000)][-1]
    new = SessionIdGenerator(WallClock(1_700_000_000.001))
    assert new() > last_old


def test_ids_fit_in_a_signed_64_bit_field_for_centuries():
    """Ids stay within the wire's i64 field for the foreseeable future."""
    assert SessionIdGenerator(WallClock(8_000_000_000.0))() <= SESSION_ID_MAX  # year 2223


def test_ids_are_unique_across_threads():
    """Threads sharing a producer never get the same id."""
    ids = SessionIdGenerator()
    seen: list[list[int]] = []
    barrier = threading.Barrier(4)

    def take() -> None:
        barrier.wait()
        seen.append([ids() for _ in range(5000)])

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    flat = [i for chunk in seen for i in chunk]
    assert len(flat) == 20000 and len(set(flat)) == 20000


def test_default_producer_id_is_valid_and_new_for_every_producer():
    """The derived producer id fits the wire's producer field (1-64 printable ASCII, also
    for the longest host name) and every call, i.e. every client, gets its own: two
    clients in one process share host and pid and seed their session ids from the same
    clock, so a shared producer id made the server take one's messages for resends of
    the other's (issue 13, item 2)."""
    ids = [default_producer_id() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(1 <= len(p) <= 64 and p.isascii() and p.isprintable() for p in ids)


def test_default_producer_id_stays_within_64_characters_for_a_long_host_name(monkeypatch):
    """A 255-character host name and a 7-digit pid still give an id the server accepts."""
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "h" * 255)
    monkeypatch.setattr(os, "getpid", lambda: 4_194_304)
    producer = default_producer_id()
    assert len(producer) <= 64 and producer.startswith("py-" + "h" * 32 + "-4194304-")

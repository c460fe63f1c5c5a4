"""Ports for servers dmq and its tests start: outside the kernel's ephemeral range, so an
outgoing connection never takes one between the choice and the bind or during a restart."""

from __future__ import annotations

import socket

from dmq_sql import ports


def test_fresh_ports_differ_and_stay_out_of_the_ephemeral_range():
    low, high = ports.ephemeral_range()
    given = [ports.fresh_port() for _ in range(50)]
    assert len(set(given)) == 50
    assert all(not low <= p <= high for p in given)
    assert all(ports.FRESH[0] <= p < ports.FRESH[1] for p in given)


def test_a_seed_keeps_its_port_while_it_is_free_and_moves_off_it_when_taken():
    first = ports.pick_port("127.0.0.1", "/var/lib/dmq")
    assert ports.pick_port("127.0.0.1", "/var/lib/dmq") == first
    assert ports.STABLE[0] <= first < ports.STABLE[1]
    with socket.create_server(("127.0.0.1", first)):
        assert not ports.port_free("127.0.0.1", first)
        assert ports.pick_port("127.0.0.1", "/var/lib/dmq") != first
    assert ports.pick_port("127.0.0.1", "/var/lib/dmq", avoid={first}) != first


def test_the_ephemeral_range_is_skipped_even_inside_the_band(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (20000, 29000))
    assert 29000 < ports.pick_port("127.0.0.1", "x") < 30000

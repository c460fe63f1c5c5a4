"""Message ids: nsqd's snowflake."""

from __future__ import annotations

from dmq_server.core.ids import TWEPOCH, GuidFactory, default_node_id, hex_id, parse_hex_id


def test_guid_layout_matches_nsqd():
    """id = ((ns>>20) - twepoch) << 22 | node << 12 | sequence."""
    now = 1_700_000_000_000_000_000
    f = GuidFactory(5, lambda: now)
    first, second = f.new(), f.new()
    assert first == (((now >> 20) - TWEPOCH) << 22) | (5 << 12)
    assert second == first + 1


def test_guid_never_repeats_when_sequence_runs_out_or_clock_goes_back():
    """4096 ids in one tick borrow the next tick; a clock going back never repeats an id."""
    times = [1_700_000_000_000_000_000]
    f = GuidFactory(1, lambda: times[0])
    ids = [f.new() for _ in range(5000)]
    times[0] -= 10**9
    ids += [f.new() for _ in range(10)]
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)


def test_hex_ids_round_trip():
    """Wire ids are 16 lowercase hex chars; parsing refuses anything else."""
    assert hex_id(255) == b"00000000000000ff"
    assert parse_hex_id(hex_id(123456789)) == 123456789
    assert parse_hex_id(b"zz00000000000000") is None
    assert parse_hex_id(b"ff") is None


def test_default_node_id_in_range():
    """The default node id is crc32(md5(hostname)) % 1024."""
    assert 0 <= default_node_id("example-host") < 1024
    assert default_node_id("a") == default_node_id("a")

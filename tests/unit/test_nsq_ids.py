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


def test_a_batch_of_ids_is_what_one_call_per_id_gives():
    """new_hex_many(n) equals n calls of new_hex on a twin factory, through a fresh tick,
    a tick shared with earlier ids, a sequence running out mid-batch, a clock going
    back, and a clock before nsqd's epoch (two's complement, as hex_id)."""
    times = [1_700_000_000_000_000_000]
    one, many = GuidFactory(7, lambda: times[0]), GuidFactory(7, lambda: times[0])

    def both(count: int) -> None:
        assert many.new_hex_many(count) == [one.new_hex() for _ in range(count)]

    both(3)  # a fresh tick
    both(100)  # the same tick
    both(5000)  # runs past 4096 in one tick
    times[0] += 1 << 20
    both(1)  # the next tick, while the borrowed ones are still ahead
    times[0] += 10 << 20
    both(4096)
    times[0] -= 10**9  # the clock goes back
    both(50)
    assert many.new_hex_many(0) == []
    both(2)
    times[0] = 5 << 20  # before 2010: negative ids in two's complement
    ancient_one, ancient_many = GuidFactory(3, lambda: times[0]), GuidFactory(3, lambda: times[0])
    assert ancient_many.new_hex_many(4) == [ancient_one.new_hex() for _ in range(4)]
    assert int(ancient_many.new_hex_many(1)[0], 16) >= 1 << 63  # the sign bit

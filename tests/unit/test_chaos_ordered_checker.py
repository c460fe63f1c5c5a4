"""The ordered chaos scenario's checker (tests/chaos/ordered.py) counts what it claims to:
per channel and key, lost, first deliveries out of commit order, two messages of a key out
at once (a copy counts as out until its ack, its consumer's death or the server's kill),
a copy pushed again while still held; and the messages held back behind their key."""

from __future__ import annotations

from tests.chaos.ordered import Attempt, check_order, key_history

SENDS = {"k": [(1, 0.0), (2, 0.1), (3, 0.2)]}


def _push(mid: int, at: float, end: float | None, how: str = "ack", consumer: str = "c0", key: str = "k",
          channel: str = "a") -> Attempt:
    return Attempt(channel, consumer, mid, key, 1, at, end, how if end is not None else "")


def _one(attempts: list[Attempt], kills: list[float] | None = None, sends=None):
    return check_order(SENDS if sends is None else sends, attempts, kills or [], ["a"])["a"]


def test_one_at_a_time_in_order_is_clean_and_counts_the_held_back():
    c = _one([_push(1, 1.0, 1.5), _push(2, 1.6, 1.7), _push(3, 1.8, 1.9)])
    assert (c.sent, c.delivered, c.pushes, c.lost, c.keys) == (3, 3, 3, 0, 1)
    assert c.order_violations == c.overlaps == c.same_id_overlaps == [] and c.ok()
    assert c.waited == 2  # 2 and 3 were acknowledged to the producer while 1 and 2 were out


def test_a_second_message_of_the_key_pushed_before_the_first_was_let_go_is_an_overlap():
    c = _one([_push(1, 1.0, 1.5), _push(2, 1.4, 1.7, consumer="c1"), _push(3, 1.8, 1.9)])
    assert len(c.overlaps) == 1 and "id 2 pushed to c1" in c.overlaps[0] and not c.ok()
    assert c.bad_keys == ["k"]


def test_a_push_never_let_go_overlaps_everything_after_it():
    c = _one([_push(1, 1.0, None), _push(2, 5.0, 5.1), _push(3, 6.0, 6.1)])
    assert len(c.overlaps) == 2


def test_a_copy_is_out_until_its_consumer_dies_or_the_server_is_killed():
    # 1's consumer died at 1.2 and 1 went out again at 1.3 (the same id: fine), 2 after its ack
    died = _one([_push(1, 1.0, 1.2, "consumer killed"), _push(1, 1.3, 1.4, consumer="c1"), _push(2, 1.5, 1.6),
                 _push(3, 1.7, 1.8)])
    assert died.ok() and died.redelivered == 1
    assert died.redelivered_ahead == 1  # 2 was stored (acknowledged at 0.1) when 1 came back
    # its consumer saw its connection go at 3.0, but the server was killed at 1.2: out until then
    killed = _one([_push(1, 1.0, 3.0, "connection lost"), _push(1, 2.0, 2.1, consumer="c1"), _push(2, 2.2, 2.3),
                   _push(3, 2.4, 2.5)], kills=[1.2])
    assert killed.ok()
    assert not _one([_push(1, 1.0, 3.0, "connection lost"), _push(2, 2.2, 2.3), _push(3, 2.4, 2.5)]).ok()


def test_the_same_id_pushed_again_while_held_is_counted_and_ends_the_earlier_push():
    c = _one([_push(1, 1.0, 2.0), _push(1, 1.5, 1.6, consumer="c1"), _push(2, 1.7, 1.8), _push(3, 1.9, 2.1)])
    assert len(c.same_id_overlaps) == 1 and "id 1 pushed again" in c.same_id_overlaps[0]
    assert c.overlaps == []  # 1's first push counts as taken back at 1.5, not as out until 2.0


def test_first_deliveries_out_of_commit_order_and_lost_messages():
    swapped = _one([_push(2, 1.0, 1.1), _push(1, 1.2, 1.3), _push(3, 1.4, 1.5)])
    assert len(swapped.order_violations) == 1 and "first pushed [2, 1, 3]" in swapped.order_violations[0]
    # a redelivery after later ones does not count against the order: first pushes do
    again = _one([_push(1, 1.0, 1.1), _push(2, 1.2, 1.3), _push(3, 1.4, 1.5), _push(1, 1.6, 1.7)])
    assert again.order_violations == [] and again.ok()
    # a message its producer never heard of (stored, its answer lost) counts by its id
    unheard = _one([_push(1, 1.0, 1.1), _push(3, 1.2, 1.3), _push(2, 1.4, 1.5)], sends={"k": [(1, 0.0), (3, 0.1)]})
    assert len(unheard.order_violations) == 1
    lost = _one([_push(1, 1.0, 1.1), _push(3, 1.4, 1.5)])
    assert lost.lost == 1 and lost.lost_examples == ["a k: ids [2] acknowledged to its producer, never pushed"]
    assert not lost.ok()
    never = _one([])
    assert (never.lost, never.keys) == (3, 0)


def test_acks_out_of_id_order_break_the_premise():
    c = _one([_push(2, 1.0, 1.1), _push(1, 1.2, 1.3)], sends={"k": [(2, 0.0), (1, 0.1)]})
    assert any("not in id order" in v for v in c.order_violations)


def test_keys_and_channels_are_counted_apart():
    attempts = [_push(1, 1.0, 2.0), _push(7, 1.5, 1.6, key="j"), _push(1, 1.0, 1.1, channel="b"),
                _push(2, 1.2, 1.3, channel="b")]
    out = check_order({"k": [(1, 0.0), (2, 0.1)], "j": [(7, 0.0)]}, attempts + [_push(2, 2.1, 2.2)], [], ["a", "b"])
    assert out["a"].ok() and out["a"].keys == 2
    # j never went out on b; k's order and overlaps on b are b's own (1 and 2 one after the other)
    assert out["b"].lost == 1 and out["b"].bad_keys == ["j"] and out["b"].overlaps == []


def test_a_key_history_tells_the_story_in_time_order():
    lines = key_history(SENDS, [_push(1, 1.0, 1.2, "consumer killed"), _push(1, 1.3, 1.4, consumer="c1")], [1.25],
                        "a", "k", origin=1.0)
    assert lines[0].endswith("id 1 acknowledged to its producer") and lines[0].startswith("   -1.000 s")
    assert [line.split(" s  ", 1)[1] for line in lines[3:]] == [
        "id 1 pushed to c0 (attempts 1)", "id 1 let go by c0: consumer killed", "the dmq server killed (-9)",
        "id 1 pushed to c1 (attempts 1)", "id 1 let go by c1: ack"]


def test_a_copy_let_go_unacknowledged_must_be_the_next_of_its_key_to_go_out():
    # 1's consumer died holding it; 2 went out before 1 came back: 1 lost its place
    passed = _one([_push(1, 1.0, 1.2, "consumer killed"), _push(2, 1.3, 1.4, consumer="c1"),
                   _push(1, 1.5, 1.6, consumer="c1"), _push(3, 1.7, 1.8)])
    assert len(passed.passed) == 1 and "id 2 pushed to c1" in passed.passed[0] and not passed.ok()
    assert passed.overlaps == [] and passed.order_violations == []  # only this rule sees it
    # the server killed at 1.2 while 1 was out: after its restart 2 may not go first either
    restarted = [_push(1, 1.0, 3.0, "connection lost"), _push(2, 3.1, 3.2), _push(1, 3.3, 3.4), _push(3, 3.5, 3.6)]
    assert len(_one(restarted, kills=[1.2]).passed) == 1
    # an ack taken after the kill's moment may have reached the server before it died
    acked_late = [_push(1, 1.0, 1.3), _push(2, 3.1, 3.2), _push(3, 3.5, 3.6)]
    assert _one(acked_late, kills=[1.2]).ok()


def test_an_earlier_message_whose_ack_died_with_the_server_may_come_back_first():
    """A run's history (audit k0498, 07:15 UTC): 2857's ack reached the server, which pushed
    2860, and died before the ack was durable; restarted, it pushed 2857 again, then 2860,
    in id order. Not a passed redelivery; a first push of another message would be."""
    sends = {"k": [(2857, 11.934), (2860, 11.942), (2863, 11.955)]}
    history = [_push(2857, 11.934, 11.994), _push(2860, 11.995, 12.017, "connection lost"),
               _push(2857, 12.833, 12.861), _push(2860, 12.863, 12.880), _push(2863, 12.881, 12.881)]
    assert _one(history, kills=[12.0], sends=sends).ok()
    jumped = history[:2] + [_push(2863, 12.833, 12.861), _push(2860, 12.863, 12.880)]
    c = _one(jumped, kills=[12.0], sends=sends)
    assert len(c.passed) == 1 and "id 2863" in c.passed[0]
    # a lower id going out for the first time is no message coming back: it passed 2860
    early = [_push(2860, 11.995, 12.017, "connection lost"), _push(2857, 12.833, 12.861), _push(2860, 12.863, 12.88)]
    assert len(_one(early, kills=[12.0], sends=sends).passed) == 1

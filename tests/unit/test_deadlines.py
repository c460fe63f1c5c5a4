"""The deadline tracker both stores keep their in-flight and deferred messages in
(dmq_server/core/deadlines.py): due keys in deadline order, re-set and discarded keys
never come back, stale entries stay bounded."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dmq_server.core import deadlines as module
from dmq_server.core.deadlines import Deadlines

pytestmark = pytest.mark.unit


def test_due_keys_come_out_earliest_first_and_only_when_due():
    d = Deadlines()
    for key, at in (("c", 5.0), ("a", 1.0), ("b", 3.0)):
        d.set(key, at)
    assert list(d.pop_due(0.5)) == []
    assert list(d.pop_due(3.0)) == ["a", "b"]
    assert len(d) == 1 and "c" in d and d.deadline("c") == 5.0
    assert list(d.pop_due(3.0)) == []


def test_a_touched_key_is_due_at_its_new_deadline_only():
    """TOUCH moves a deadline later, REQ with a delay may move it earlier: the old entry
    never fires."""
    d = Deadlines()
    d.set(b"m1", 10.0)
    d.set(b"m1", 30.0)  # touched
    d.set(b"m2", 10.0)
    d.set(b"m2", 2.0)  # earlier
    assert list(d.pop_due(10.0)) == [b"m2"]
    assert list(d.pop_due(29.0)) == []
    assert list(d.pop_due(30.0)) == [b"m1"]


def test_a_discarded_key_never_fires_and_equal_deadlines_keep_arrival_order():
    d = Deadlines()
    for key in range(5):
        d.set(key, 1.0)
    d.discard(2)
    d.discard(99)  # never set: nothing happens
    assert list(d.pop_due(1.0)) == [0, 1, 3, 4]
    assert not d


def test_a_batch_set_at_once_is_bounded_as_single_sets_are(monkeypatch):
    monkeypatch.setattr(module, "SLACK", 4)
    d = Deadlines()
    for _ in range(50):
        d.set_many(range(5), 1.0)  # the same keys again: their old entries go stale
        d.set_many(range(5), 0.5)  # earlier than the FIFO's last: the heap
        assert d.entries() <= module.STALE_RATIO * len(d) + 4
    assert list(d.pop_due(0.5)) == list(range(5)) and len(d) == 0


def test_stale_entries_stay_bounded(monkeypatch):
    """Acks leave entries behind; after every ``set`` there are at most STALE_RATIO
    entries per live key (plus SLACK), whether acks come in push order or not."""
    monkeypatch.setattr(module, "SLACK", 10)
    rng = random.Random(7)
    for shuffled in (False, True):
        d = Deadlines()
        live: list[int] = []
        for i in range(10_000):
            d.set(i, float(i))
            live.append(i)
            assert d.entries() <= module.STALE_RATIO * len(d) + 10
            if len(live) > 5:  # five in flight at any time, acked oldest first or at random
                d.discard(live.pop(rng.randrange(len(live)) if shuffled else 0))
        assert sorted(d.pop_due(1e9)) == sorted(live)


def test_acks_in_push_order_leave_no_entries_behind():
    """The common case: every deadline later than the last and acks in push order, so
    ``discard`` drops the FIFO's stale front and it stays as long as what is live."""
    d = Deadlines()
    for i in range(5000):
        d.set(i, 100.0 + i)
        if i >= 3:
            d.discard(i - 3)
        assert d.entries() <= 4
    d.discard(4998)  # out of order: its entry waits behind 4997's
    assert d.entries() == 3
    d.discard(4997)  # 4997 goes, and 4998's stale entry behind it
    assert d.entries() == 1 and list(d.pop_due(1e9)) == [4999]


def test_earlier_deadlines_merge_with_later_ones_in_order():
    """A deadline earlier than the last one set (REQ with a short delay) goes to the
    heap; the two are merged by (deadline, order of setting)."""
    d = Deadlines()
    d.set("a", 10.0)
    d.set("b", 20.0)
    d.set("c", 5.0)  # earlier than b: the heap
    d.set("d", 20.0)  # equal to b, set after it
    d.set("e", 15.0)
    assert list(d.pop_due(20.0)) == ["c", "a", "e", "b", "d"]


@given(st.lists(st.tuples(st.sampled_from(["set", "set_many", "discard", "discard_many", "pop"]), st.integers(0, 20),
                          st.floats(0, 100))))
def test_it_agrees_with_a_plain_dict(operations):
    """Whatever the sequence of set, set_many, discard, discard_many and pop_due, the
    keys popped are exactly the live keys due, in (deadline, order of setting) order."""
    d, model, order = Deadlines(), {}, 0
    for op, key, at in operations:
        if op == "set":
            order += 1
            d.set(key, at)
            model[key] = (at, order)
        elif op == "set_many":  # a run of keys from ``key``, one of them twice
            keys = [key, key + 1, key + 2, key]
            d.set_many(keys, at)
            for k in keys:
                order += 1
                model[k] = (at, order)
        elif op == "discard":
            d.discard(key)
            model.pop(key, None)
        elif op == "discard_many":  # a run of keys from ``key``, one of them twice
            keys = [key, key + 1, key, key + 3]
            d.discard_many(keys)
            for k in keys:
                model.pop(k, None)
        else:
            due = sorted((v, k) for k, v in model.items() if v[0] <= at)
            assert list(d.pop_due(at)) == [k for _, k in due]
            for _, k in due:
                del model[k]
        assert len(d) == len(model)


def test_clear_returns_every_key():
    d = Deadlines()
    keys = random.Random(1).sample(range(1000), 50)
    for k in keys:
        d.set(k, 1.0)
    assert sorted(d.clear()) == sorted(keys) and not d and list(d.pop_due(2.0)) == []


def test_keys_set_while_due_ones_are_taken_are_kept(monkeypatch):
    """A scanner that redelivers each due key (setting a new deadline) while it iterates
    may make it compact its entries; no key is lost or popped twice."""
    monkeypatch.setattr(module, "SLACK", 0)
    d = Deadlines()
    for key in range(100):
        d.set(key, 1.0)
    taken = []
    for key in d.pop_due(1.0):
        taken.append(key)
        d.set(key, 100.0)  # redelivered: due again later
    assert taken == list(range(100))
    assert len(d) == 100 and list(d.pop_due(99.0)) == []
    assert sorted(d.pop_due(100.0)) == list(range(100))

"""The duplicate-suppression window: decisions, bounds by size and age, memory per entry."""

from __future__ import annotations

import tracemalloc

from dmq_client.dedup import Admit, DedupWindow


def test_first_copy_is_new_and_a_second_is_a_duplicate():
    """The first push of a key goes to the handler; a second copy is suppressed and counted."""
    window = DedupWindow(max_entries=10, max_age=60)
    key = window.key("p", 1, "billing")
    assert window.admit(key, now=0) is Admit.NEW
    assert window.admit(key, now=1) is Admit.DUPLICATE
    assert window.suppressed == 1


def test_duplicate_of_an_acked_message_is_to_be_acked():
    """Once the first copy is acked, a redelivery must be acked too, or the server keeps
    sending it."""
    window = DedupWindow(max_entries=10, max_age=60)
    key = window.key("p", 1, "billing")
    window.admit(key, now=0)
    window.acked(key)
    assert window.admit(key, now=1) is Admit.DUPLICATE_ACKED


def test_forgotten_entry_lets_the_next_copy_through():
    """After a handler failure the redelivery is new again (at least once for failures)."""
    window = DedupWindow(max_entries=10, max_age=60)
    key = window.key("p", 1, "billing")
    window.admit(key, now=0)
    window.forget(key)
    assert window.admit(key, now=1) is Admit.NEW


def test_key_separates_producers_and_channels():
    """Session ids are unique per producer only; each channel has its own copy."""
    window = DedupWindow(max_entries=10, max_age=60)
    assert window.admit(window.key("p1", 1, "billing"), 0) is Admit.NEW
    assert window.admit(window.key("p2", 1, "billing"), 0) is Admit.NEW
    assert window.admit(window.key("p1", 1, "audit"), 0) is Admit.NEW
    assert window.admit(window.key("p1", 2, "billing"), 0) is Admit.NEW


def test_size_bound_evicts_the_oldest():
    """Beyond ``max_entries`` the oldest entries are forgotten first."""
    window = DedupWindow(max_entries=3, max_age=600)
    keys = [window.key("p", i, "c") for i in range(5)]
    for i, key in enumerate(keys):
        window.admit(key, now=i)
    assert len(window) == 3
    assert window.admit(keys[0], now=10) is Admit.NEW  # evicted, so forgotten
    assert window.admit(keys[4], now=10) is Admit.DUPLICATE


def test_age_bound_evicts_old_entries():
    """Entries older than ``max_age`` are forgotten, younger ones kept."""
    window = DedupWindow(max_entries=100, max_age=10)
    old, young = window.key("p", 1, "c"), window.key("p", 2, "c")
    window.admit(old, now=0)
    window.admit(young, now=5)
    assert window.admit(window.key("p", 3, "c"), now=10.5) is Admit.NEW
    assert len(window) == 2
    assert window.admit(old, now=11) is Admit.NEW
    assert window.admit(young, now=11) is Admit.DUPLICATE


def test_memory_per_entry_is_bounded_and_small():
    """A full window costs under 300 bytes an entry in steady state and under 350 at the
    peak of a table resize (the figures in docs/client.md); admitting five times its size
    in new keys does not grow it."""
    size = 10000
    window = DedupWindow(max_entries=size, max_age=600)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        used = []
        for round_ in range(5):
            for i in range(size):
                # fresh str objects, as the decoder makes for every push
                window.admit(window.key("producer-" + "x" * 20, 10**15 + round_ * size + i, "bill" + "ing"), now=0)
            used.append(tracemalloc.get_traced_memory()[0] - base)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert len(window) == size
    assert used[-1] / size < 300, used[-1] / size
    assert peak / size < 350, peak / size
    assert used[-1] <= used[2] * 1.05, used  # bounded: no growth once full

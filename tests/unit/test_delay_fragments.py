"""Splitting fragments among delay workers, and the single-node assignment."""

from __future__ import annotations

import pytest

from dmq_server.core.fragment_ranges import StaticAssignment, all_fragments, split_fragments


def test_eight_fragments_over_two_workers_is_one_to_four_and_five_to_eight():
    """The issue's example, DMQ's DelayJOB split: 1-4 and 5-8."""
    assert split_fragments(all_fragments(8), 2) == [(1, 2, 3, 4), (5, 6, 7, 8)]


@pytest.mark.parametrize(
    "count, workers, expected",
    [
        (8, 1, [(1, 2, 3, 4, 5, 6, 7, 8)]),
        (8, 3, [(1, 2, 3), (4, 5, 6), (7, 8)]),
        (9, 2, [(1, 2, 3, 4, 5), (6, 7, 8, 9)]),
        (2, 4, [(1,), (2,), (), ()]),
    ],
)
def test_runs_are_contiguous_in_order_and_differ_by_at_most_one(count, workers, expected):
    """Runs cover every fragment once, in order; larger runs first; spare workers idle."""
    runs = split_fragments(all_fragments(count), workers)
    assert runs == expected
    assert [f for run in runs for f in run] == list(range(1, count + 1))


def test_owned_subset_is_split_in_order():
    """A node owning a scattered subset (after a cluster rebalance) splits it in order."""
    assert split_fragments({7, 2, 5, 3}, 2) == [(2, 3), (5, 7)]


def test_bad_counts_are_refused_with_a_clear_message():
    """Zero workers or fragments is an error that names the problem."""
    with pytest.raises(ValueError, match="worker count"):
        split_fragments({1}, 0)
    with pytest.raises(ValueError, match="fragment count"):
        all_fragments(0)


def test_static_assignment_owns_everything_and_reports_it_at_start():
    """Single node: all fragments, announced once through on_change."""
    seen = []
    assignment = StaticAssignment(8)
    assignment.start(seen.append)
    assert seen == [frozenset(range(1, 9))]
    assert assignment.describe()["owned"] == list(range(1, 9))

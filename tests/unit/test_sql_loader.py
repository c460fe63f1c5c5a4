"""The named-query loader: blocks, shared fragments, and the mistakes it refuses."""

from __future__ import annotations

import pytest

from dmq_sql import load_queries, queries

TEXT = """
-- fragment: live
-- rows not deleted
deleted_at IS NULL OR deleted_at > now()

-- name: count_live
-- how many
SELECT count(*) FROM t WHERE /*live*/ AND kind = %(kind)s;
"""


def test_a_fragment_is_filled_in_parenthesised_without_its_description():
    assert load_queries(TEXT) == {
        "count_live": "-- how many\nSELECT count(*) FROM t WHERE (deleted_at IS NULL OR deleted_at > now())"
        " AND kind = %(kind)s"
    }


def test_an_unknown_fragment_is_refused():
    with pytest.raises(ValueError, match="unknown fragment /\\*alive\\*/"):
        load_queries(TEXT.replace("/*live*/", "/*alive*/"))


@pytest.mark.parametrize("block", ["-- name: count_live", "-- fragment: live"])
def test_a_name_defined_twice_is_refused(block):
    with pytest.raises(ValueError, match="defined twice"):
        load_queries(TEXT + f"\n{block}\n-- again\nSELECT 1;\n")


def test_every_dead_letter_operation_uses_the_same_selection():
    names = ("list_dead_letters", "count_dead_letters", "replay_dead_letters", "delete_dead_letters")
    for name in names:
        assert "%(message_ids)s::bigint[] IS NULL OR message_id = ANY" in queries[name]
        assert "/*" not in queries[name]

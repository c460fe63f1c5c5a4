"""Which storing statement a batch runs (schema version 15): a batch that holds an outbox
relay's rows records them in the same statement (insert_outbox_messages,
insert_outbox_delayed); any other batch runs the statements every send ran before, and
pays nothing for the outbox. The statements' answers are checked against PostgreSQL by
tests/integration/test_memory_db_contract.py; here the choice, and the in-memory double's
record (a recorded row is never stored again, also once its message was swept)."""

from __future__ import annotations

from typing import Callable, TypeVar

import pytest

from dmq_server.core.outbox_rows import OutboxRow, producer_of
from dmq_server.db.delays import NewDelayed, insert_delayed_steps
from dmq_server.db.memory import MemoryDb
from dmq_server.db.messages import (
    NewMessage, StoredMessage, create_owner_steps, holds_outbox_rows, insert_messages_steps,
)
from dmq_server.db.steps import Statement, Steps
from dmq_server.db.storage_errors import Misplaced

pytestmark = pytest.mark.unit

T = TypeVar("T")

RELAYED = producer_of("shop", "0000abcd", OutboxRow(7, "orders", b"x", None, None, 0))
OWN_DELAYED = producer_of("shop", "0000abcd", OutboxRow(8, "orders", b"x", 1, 42, 0))


@pytest.mark.parametrize("producers, holds", [
    ([], False),
    (["a", "p"], False),
    (["a", RELAYED, "p"], True),
    ([RELAYED], True),
    (["outbox", "outboy:x", "zz"], False),  # no colon, or past the prefix
    (["a", OWN_DELAYED], True),
])
def test_a_sorted_batch_holds_outbox_rows_when_a_relay_producer_is_among_them(producers: list[str], holds: bool) -> None:
    assert holds_outbox_rows(sorted(producers)) is holds


def _first(steps: Steps[object]) -> Statement:
    return next(steps)


def test_only_a_batch_with_outbox_rows_runs_the_recording_statement() -> None:
    plain = [NewMessage("orders", "p", 1, 0, b"x"), NewMessage("orders", "q", 1, 0, b"y")]
    mixed = plain + [NewMessage("orders", RELAYED, 7, 0, b"z")]
    assert _first(insert_messages_steps(plain, "n", 1)).name == "insert_new_messages"
    assert _first(insert_messages_steps(mixed, "n", 1)).name == "insert_new_outbox_messages"
    assert _first(insert_delayed_steps([NewDelayed(NewMessage("orders", "p", 1, 0, b"x"), 5, 1)], "n")).name == "insert_delayed"
    delayed = [NewDelayed(NewMessage("orders", "p", 1, 0, b"x"), 5, 1), NewDelayed(NewMessage("orders", OWN_DELAYED, 42, 0, b"y"), 5, 1)]
    assert _first(insert_delayed_steps(delayed, "n")).name == "insert_outbox_delayed"


def _run(db: MemoryDb, steps_fn: Callable[..., Steps[T]], *args: object) -> T:
    out: list[T] = []
    db.run_steps(steps_fn, *args).addCallback(out.append)
    return out[0]


def _stored(answer: StoredMessage | Misplaced) -> StoredMessage:
    assert isinstance(answer, StoredMessage), answer
    return answer


def test_the_double_never_stores_a_recorded_outbox_row_again_even_once_swept() -> None:
    db = MemoryDb()
    db.create_topic("orders")
    owner = _run(db, create_owner_steps, "n")
    first = _stored(_run(db, insert_messages_steps, [NewMessage("orders", RELAYED, 7, 0, b"z")], "n", owner)[0])
    assert not first.duplicate and (RELAYED, 7) in db.relayed
    again = _stored(_run(db, insert_messages_steps, [NewMessage("orders", RELAYED, 7, 0, b"z")], "n", owner)[0])
    assert again.duplicate and again.message_id == first.message_id
    db.messages.clear()  # swept (no channel holds it)
    db._pairs.clear()
    swept = _run(db, insert_messages_steps,
                 [NewMessage("orders", RELAYED, 7, 0, b"z"), NewMessage("orders", "p", 7, 0, b"other")], "n", owner)
    assert isinstance(swept[0], Misplaced) and not _stored(swept[1]).duplicate
    assert [m.producer for m in db.messages.values()] == ["p"]

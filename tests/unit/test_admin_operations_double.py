"""The admin operations (``admin.operations.AdminOps``) on the in-memory double, fast.

A real ``Broker`` on ``MemoryDb`` (the harness of ``test_broker``), the operations every
admin surface offers: stats, topic and channel admin, the dead letters' list, show,
count, replay and delete with their audit rows, a client's report, delay stats. The
double answers their statements as PostgreSQL does
(tests/integration/test_memory_db_contract.py holds it to that), so these run in
milliseconds what tests/integration/test_admin_*.py run against a server.
"""

from __future__ import annotations

import pytest

from dmq_server.admin.operations import AdminOps, DeadLetterFilter, update_topic_steps
from dmq_server.core.errors import Invalid, NotFound
from dmq_server.core.options import Options
from dmq_server.db.dead_letter_steps import NewDeadLetter, insert_dead_letters_steps
from dmq_server.db.delays import move_due_steps
from dmq_server.db.storage_errors import StorageError
from tests.unit.test_broker import NODE, Consumer, Harness
from tests.unit.test_memory_db import result



@pytest.fixture
def h() -> Harness:
    return Harness()


@pytest.fixture
def ops(h: Harness) -> AdminOps:
    return AdminOps(broker=h.broker, delays=None, db=h.db, options=Options(), clock=h.clock, node_id=NODE,
                    batch_size=2)


def letters(h: Harness, *items: tuple[str, str | None, str]) -> list[int]:
    """Dead letters (reason, channel, body) of topic orders, as the sink records them."""
    batch = [NewDeadLetter(reason, "orders", "p", n, body.encode(), channel=channel, detail=f"#{n}")
             for n, (reason, channel, body) in enumerate(items, 1)]
    return result(h.db.run_steps(insert_dead_letters_steps, batch))


def test_stats_count_what_is_stored_waiting_and_dead(h, ops):
    for n in range(3):
        h.send("orders", "p", n)
    h.settle()
    billing = Consumer()
    h.subscribe("orders", "billing", billing)
    h.ack_all("orders", billing)
    h.settle()
    letters(h, ("client_reported", None, "x"))
    stats = result(ops.stats())
    stored = stats["stored"]
    assert stored["messages"] == 3 and stored["deliveries_pending"] == 3  # audit's; billing acknowledged
    assert stored["delivery_log"] == 3
    assert stored["channels"] == [{"topic": "orders", "channel": "audit", "stored_depth": 3}]
    assert stored["dead_letters"] == {"total": 1, "replayed": 0, "by_reason": {"client_reported": 1}}
    assert stored["delayed_pending"] == 0 and stats["delay"] is None


def test_dead_letters_are_listed_by_filter_shown_and_counted(h, ops):
    first, second, third = letters(h, ("client_reported", "billing", "one"), ("rate_limited", None, "two"),
                                   ("client_reported", "audit", "\xff"))
    rows = result(ops.dlq_list(DeadLetterFilter(reason="client_reported")))
    assert [r["id"] for r in rows] == [first, third]
    assert result(ops.dlq_list(DeadLetterFilter(), limit=1, after=first))[0]["id"] == second
    shown = result(ops.dlq_show(third))
    assert shown["body"] == "\xff" and shown["body_encoding"] == "utf-8" and shown["size"] == 2
    assert isinstance(result(ops.dlq_show(999_999)), NotFound)
    assert result(ops.dlq_count(DeadLetterFilter(ids=(first, second)))) == (2, 2)


def test_replay_queues_each_letter_for_its_own_channel_once_and_is_audited(h, ops):
    ids = letters(h, ("client_reported", "billing", "a"), ("client_reported", None, "b"), ("rate_limited", None, "c"))
    assert isinstance(result(ops.dlq_replay(DeadLetterFilter(), False, "http", "me")), Invalid)  # no selection
    progress: list[tuple[int, int]] = []
    done = result(ops.dlq_replay(DeadLetterFilter(reason="client_reported"), False, "http", "me",
                                 progress=lambda n, total: progress.append((n, total))))
    assert done == 2 and progress == [(2, 2)]  # batches of 2
    queued = sorted((r["replay_of"], r["channel"], r["producer"], r["session_id"]) for r in h.db.delayed.values())
    assert queued == [(ids[0], "billing", "dmq-replay", ids[0]), (ids[1], None, "dmq-replay", ids[1])]
    assert result(ops.dlq_count(DeadLetterFilter(replayed=False))) == (1, 1)
    assert result(ops.dlq_replay(DeadLetterFilter(), True, "cli", "you")) == 1  # the third; the two not again
    assert len(h.db.delayed) == 3
    audit = [(r["surface"], r["actor"], r["operation"], r["filters"], r["affected"]) for r in h.db.admin_log]
    assert audit == [("http", "me", "dlq.replay", "reason=client_reported", 2), ("cli", "you", "dlq.replay", "all", 1)]
    # due now: the delay workers store each as a message for its channel, the letter pointing at it
    owner = h.broker.reliable.writes.owner
    taken, moved = result(h.db.run_steps(move_due_steps, (1, 2, 3, 4), 4, 2**62, 10, NODE, owner))
    assert taken == 3
    by_letter = {m.session_id: m for m in moved}
    assert by_letter[ids[0]].channels == ("billing",) and by_letter[ids[1]].channels == ("audit", "billing")
    assert h.db.dead_letters[ids[0]]["replay_message_id"] == by_letter[ids[0]].message_id


def test_a_replay_that_fails_in_the_database_writes_no_audit_row(h, ops):
    letters(h, ("client_reported", None, "a"))
    h.db.fail_next("replay_dead_letters", "lost")
    assert isinstance(result(ops.dlq_replay(DeadLetterFilter(), True, "http", "me")), StorageError)
    assert h.db.admin_log == [] and h.db.delayed == {}
    assert result(ops.dlq_count(DeadLetterFilter(replayed=False))) == (1, 1)  # nothing was marked


def test_delete_removes_the_selection_in_batches_and_is_audited(h, ops):
    ids = letters(h, *[("client_reported", None, str(n)) for n in range(5)])
    assert isinstance(result(ops.dlq_delete(DeadLetterFilter(), False, "console", "me")), Invalid)
    progress: list[tuple[int, int]] = []
    assert result(ops.dlq_delete(DeadLetterFilter(ids=tuple(ids[:3])), False, "console", "me",
                                 progress=lambda n, total: progress.append((n, total)))) == 3
    assert progress == [(2, 3), (3, 3)]
    assert sorted(h.db.dead_letters) == ids[3:]
    assert h.db.admin_log[-1]["operation"] == "dlq.delete" and h.db.admin_log[-1]["affected"] == 3


def test_a_client_report_is_a_dead_letter(h, ops):
    letter_id = result(ops.dlq_report({"topic": "orders", "producer": "p", "session_id": 4, "body": "aGk=",
                                       "body_encoding": "base64"}, "http", "me"))
    stored = h.db.dead_letters[letter_id]
    assert (stored["reason"], stored["body"], stored["detail"]) == ("client_reported", b"hi", "reported by the client")


def test_topic_settings_change_in_one_transaction_and_refuse_what_is_invalid(h):
    before, after = result(h.db.run_steps(update_topic_steps, "orders", {"rate_limit": 50, "ttl_ms": None}))
    assert before["rate_limit"] is None and after["rate_limit"] == 50
    assert h.db.topics["orders"]["rate_limit"] == 50
    assert h.db.names_run()[-2:] == ["lock_topic_settings", "update_topic_settings"]
    assert isinstance(result(h.db.run_steps(update_topic_steps, "nowhere", {"rate_limit": 5})), NotFound)
    refused = result(h.db.run_steps(update_topic_steps, "orders", {"msg_timeout_ms": None}))
    assert isinstance(refused, Invalid) and h.db.topics["orders"]["msg_timeout_ms"] == 60000
    assert h.db.names_run()[-1] == "lock_topic_settings"  # nothing was written


def test_ordered_is_a_topic_setting_the_broker_hands_its_reliable_store(h, ops):
    """``ordered`` changes in place like the limits (the other settings stay), only as a
    true or false; the broker's registry refresh hands the new ``TopicSpec`` to the
    reliable store (what its channels read), and the admin surfaces show it."""
    assert not h.broker.reliable.topics["orders"].ordered and ops.topics()[0]["ordered"] is False
    before, after = result(h.db.run_steps(update_topic_steps, "orders", {"ordered": True}))
    assert (before["ordered"], after["ordered"]) == (False, True)
    assert h.db.topics["orders"]["ordered"] and h.db.topics["orders"]["msg_timeout_ms"] == 60000
    refreshed = h.broker.cache.refresh(fresh=True)
    h.settle()
    result(refreshed)
    assert h.broker.reliable.topics["orders"].ordered and h.broker.topics["orders"].ordered
    assert not h.broker.reliable.topics["limited"].ordered
    assert [t["ordered"] for t in ops.topics() if t["name"] == "orders"] == [True]
    refused = result(h.db.run_steps(update_topic_steps, "orders", {"ordered": 1}))
    assert isinstance(refused, Invalid) and "ordered must be true or false" in str(refused)
    assert h.db.topics["orders"]["ordered"] is True
    _, after = result(h.db.run_steps(update_topic_steps, "orders", {"ordered": False, "max_attempts": 4}))
    assert (after["ordered"], after["max_attempts"]) == (False, 4) and "store" not in after
    fast = result(h.db.run_steps(update_topic_steps, "clicks", {"ordered": True}))
    assert isinstance(fast, Invalid) and "only a reliable topic can be ordered" in str(fast)
    assert h.db.topics["clicks"]["ordered"] is False
    assert result(h.db.run_steps(update_topic_steps, "clicks", {"ordered": False}))[1]["ordered"] is False


def test_channels_are_paused_unpaused_and_emptied_through_the_broker(h, ops):
    for n in range(4):
        h.send("orders", "p", n)
    h.settle()
    assert result(ops.channel_action("pause", "orders", "audit", "http", "me")) == "pause orders/audit"
    assert h.db.pauses == {("orders", "audit")}
    result(ops.channel_action("unpause", "orders", "audit", "http", "me"))
    assert h.db.pauses == set()
    assert result(ops.channel_action("empty", "orders", "audit", "http", "me")).endswith(": 4 stored copies dropped")
    assert {c for _, c, _ in h.db.deliveries} == {"billing"}
    assert isinstance(result(ops.channel_action("pause", "orders", "nobody", "http", "me")), NotFound)
    with pytest.raises(Invalid):
        ops.channel_action("drain", "orders", "audit", "http", "me")


def test_delay_stats_count_the_delayed_sends_stored(h, ops):
    now_ms = int(h.clock.seconds() * 1000)
    h.send("orders", "d", 1, due_ms=now_ms + 60_000)
    h.send("orders", "d", 2, due_ms=now_ms + 120_000)
    h.settle()
    stats = result(ops.delay_stats())
    assert stats["pending"] == 2
    assert sum(f["pending"] for f in stats["stored"]) == 2
    assert min(f["next_due_ms"] for f in stats["stored"]) == now_ms + 60_000

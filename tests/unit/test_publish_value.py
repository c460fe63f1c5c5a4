"""The one publish value (``core.publish``): keyword fields only, its fast constructors
the same value, its two forms answering the same questions."""

from __future__ import annotations

from dataclasses import fields

import pytest

from dmq_client.wire.properties import Properties
from dmq_server.core.errors import Invalid
from dmq_server.core.publish import PublishRequest, Send, check_request, new_request, new_send


def _each_field_distinct(cls: type) -> dict:
    """A value for every field of ``cls``, each different from its default."""
    values = {"topic": "t", "producer": "p", "session_id": 7, "body": b"b", "produced_ms": 5, "resend": False,
              "bodies": [b"x"], "sends": [], "due_ms": 9, "create_fast": True,
              "properties": Properties(key="k", priority=3), "status": '{"key":"k","priority":3}'}
    missing = {f.name for f in fields(cls)} - set(values)
    assert not missing, f"give the new fields of {cls.__name__} a test value: {missing}"
    return {f.name: values[f.name] for f in fields(cls)}


@pytest.mark.parametrize("cls, fast", [(Send, new_send), (PublishRequest, new_request)])
def test_the_fast_constructors_set_every_field_as_the_class_does(cls, fast):
    """``new_send``/``new_request`` skip the class call's keyword dict; a field added to
    the value and not to its constructor fails here (unset, or its default not kept)."""
    given = _each_field_distinct(cls)
    assert fast(**given) == cls(**given)
    required = {f.name: given[f.name] for f in fields(cls) if f.default is f.default_factory}
    assert fast(**required) == cls(**required)


def test_no_field_is_positional():
    """Fields are added by name (as the properties were): nothing positional."""
    with pytest.raises(TypeError):
        Send("t", "p", 1, b"b")  # type: ignore[misc]
    with pytest.raises(TypeError):
        PublishRequest("t", "p", [b"b"])  # type: ignore[misc]


def test_both_forms_answer_the_same_questions():
    """Bodies (numbered by the broker) and sends (numbered by their producer): how many,
    their bodies, each as a Send, each as a request of its own."""
    bodies = PublishRequest(topic="t", producer="p", bodies=[b"a", b"b"], produced_ms=3, due_ms=4)
    ids = iter((11, 12))
    assert len(bodies) == 2 and bodies.payloads() == [b"a", b"b"]
    assert bodies.numbered(lambda: next(ids)) == [
        Send(topic="t", producer="p", session_id=11, body=b"a", produced_ms=3),
        Send(topic="t", producer="p", session_id=12, body=b"b", produced_ms=3),
    ]
    assert bodies.alone(1) == PublishRequest(topic="t", producer="p", bodies=[b"b"], produced_ms=3, due_ms=4)
    one, two = (Send(topic="t", producer="p", session_id=i, body=b"%d" % i, resend=False) for i in (1, 2))
    sends = PublishRequest(topic="t", producer="p", sends=[one, two])
    assert len(sends) == 2 and sends.payloads() == [b"1", b"2"] and sends.numbered(lambda: 0) == [one, two]
    assert sends.alone(1) == PublishRequest(topic="t", producer="p", sends=[two])


def test_each_send_of_a_request_is_checked():
    """A bad session id or time on any send fails the request, as a bad body size does."""
    ok = Send(topic="t", producer="p", session_id=1, body=b"x")
    bad = Send(topic="t", producer="p", session_id=-1, body=b"x")
    late = Send(topic="t", producer="p", session_id=2, body=b"x", produced_ms=-5)

    def check(request: PublishRequest) -> object:
        return check_request(request, registered=True, max_msg_size=10, max_delay_s=60, now_s=0)

    assert check(PublishRequest(topic="t", producer="p", sends=[ok])) is None
    for wrong in (bad, late):
        error = check(PublishRequest(topic="t", producer="p", sends=[ok, wrong]))
        assert isinstance(error, Invalid)
    error = check(PublishRequest(topic="t", producer="p", bodies=[b"x" * 11]))
    assert isinstance(error, Invalid) and error.code == "E_BAD_BODY"


def test_a_runs_check_refuses_exactly_what_each_sends_check_refuses():
    """``check_sends`` tests ``check_send``'s rules inline: on every edge of each rule
    (session id, body size, time) the two agree, with the same error."""
    from dmq_client.spelling import MAX_TIME_MS

    from dmq_server.core.publish import check_send, check_sends

    grid = [
        Send(topic="t", producer="p", session_id=sid, body=b"x" * size, produced_ms=ms)
        for sid in (-1, 0, 1) for size in (0, 10, 11) for ms in (-1, 0, MAX_TIME_MS, MAX_TIME_MS + 1)
    ]
    each = [(i, check_send(s.session_id, (s.body,), s.produced_ms, 10)) for i, s in enumerate(grid)]
    expected = [(i, e) for i, e in each if e is not None]
    got = check_sends(grid, 10)
    assert [(i, e.status) for i, e in got] == [(i, e.status) for i, e in expected]
    assert len(expected) == len(grid) - 2 * 2 * 2  # passing: session ids 0, 1; sizes 0, 10; times 0, the last

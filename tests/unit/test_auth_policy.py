"""The IO-free auth policy (core/auth.py) and one connection's auth state
(security/session.py) driven by a task.Clock: nsqd's answers, regex search, the
publish-needs-a-channel-regex rule, ttl expiry and its re-query, refusals."""

from __future__ import annotations

import json

import pytest
from twisted.internet import defer
from twisted.internet.task import Clock

from dmq_server.core.auth import ADMIN, PUBLISH, SUBSCRIBE, AnswerError, parse_answer, parse_auth_file
from dmq_server.core.errors import AuthFailed, AuthFirst, Invalid, NotPermitted
from dmq_server.security.session import ClientAuth, CredentialCache

pytestmark = pytest.mark.unit


def answer(*grants, ttl=60, identity="app"):
    return {"ttl": ttl, "identity": identity, "identity_url": "u", "authorizations": list(grants)}


def grant(topic, channels=(".*",), permissions=("publish", "subscribe")):
    return {"topic": topic, "channels": list(channels), "permissions": list(permissions)}


def test_regexes_are_searched_and_publish_needs_a_channel_regex_finding_empty():
    """As nsqd: an unanchored topic regex finds substrings; a publish is checked against
    channel "" (so channels ["^billing$"] allows subscribing to billing but no publish);
    admin is a permission of its own."""
    state = parse_answer(answer(grant("orders", ["^billing$"]), grant("^audit$", [".*"], ["admin"])), now=0)
    assert state.allows(SUBSCRIBE, "orders", "billing")
    assert state.allows(SUBSCRIBE, "old-orders", "billing")  # searched, not anchored
    assert not state.allows(SUBSCRIBE, "orders", "shipping")
    assert not state.allows(PUBLISH, "orders")  # no channel regex finds ""
    assert state.allows(ADMIN, "audit", "") and not state.allows(ADMIN, "orders", "billing")
    assert parse_answer(answer(grant("^orders$")), now=0).allows(PUBLISH, "orders")


@pytest.mark.parametrize(
    "bad, why",
    [
        ({"ttl": 0, "authorizations": []}, "invalid TTL"),
        ({"authorizations": []}, "invalid TTL"),
        (answer(grant("a", permissions=["write"])), "unknown permission"),
        (answer(grant("(")), "unable to compile topic"),
        (answer(grant("a", channels=["["])), "unable to compile channel"),
        (b"not json", "not JSON"),
        ([], "not a JSON object"),
    ],
)
def test_answers_nsqd_refuses_are_refused(bad, why):
    with pytest.raises(AnswerError, match=why):
        parse_answer(bad if isinstance(bad, (bytes, list)) else json.dumps(bad), now=0)


def test_the_auth_file_is_checked_whole_and_keyed_by_secret_or_certificate_name():
    text = json.dumps({"secrets": {"s1": answer(grant("a"))}, "common_names": {"svc": answer(grant("b"), identity="svc")}})
    auth = parse_auth_file(text)
    assert auth.answer("s1", "", now=0).identity == "app"
    assert auth.answer("", "svc", now=0).identity == "svc"
    assert auth.answer("", "", now=0) is None and auth.answer("nope", "svc", now=0) is None
    assert auth.answer("s1", "", now=10).expires == 70
    with pytest.raises(AnswerError, match=r"secrets\['s1x…'\]: unknown permission"):
        parse_auth_file(json.dumps({"secrets": {"s1xyz": answer(grant("a", permissions=["x"]))}}))


class ScriptedAuthorizer:
    """Answers queries from a list the test controls; each query is a Deferred it fires."""

    def __init__(self, clock):
        self.clock = clock
        self.pending: list[defer.Deferred] = []
        self.queries: list[tuple] = []

    def query(self, secret, remote_ip, tls, common_name):
        self.queries.append((secret, remote_ip, tls, common_name))
        d = defer.Deferred()
        self.pending.append(d)
        return d

    def answer(self, data):
        self.pending.pop(0).callback(parse_answer(data, self.clock.seconds()))

    def fail(self):
        self.pending.pop(0).errback(AuthFailed("auth server down"))


def test_ttl_expiry_asks_again_once_and_holds_the_check_meanwhile():
    clock = Clock()
    authz = ScriptedAuthorizer(clock)
    auth = ClientAuth(authz, clock, "10.0.0.1", "10.0.0.1:5000", lambda: None)
    with pytest.raises(AuthFirst, match="AUTH required before PUB"):
        auth.check("PUB", PUBLISH, "t")
    logged_in = auth.login("s")
    authz.answer(answer(grant("^t$"), ttl=10))
    assert logged_in.result.identity == "app"
    assert authz.queries == [("s", "10.0.0.1", False, "")]
    assert auth.check("PUB", PUBLISH, "t") is None
    with pytest.raises(NotPermitted, match='AUTH failed for PUB on "u" ""'):
        auth.check("PUB", PUBLISH, "u")
    clock.advance(10)
    first, second = auth.check("PUB", PUBLISH, "t"), auth.check("SUB", SUBSCRIBE, "t", "c")
    assert isinstance(first, defer.Deferred) and not first.called and len(authz.queries) == 2
    authz.answer(answer(grant("^u$"), ttl=10))
    assert first.called and second.called
    with pytest.raises(NotPermitted):
        auth.check("PUB", PUBLISH, "t")
    assert auth.check("PUB", PUBLISH, "u") is None
    clock.advance(10)
    waiting = auth.check("PUB", PUBLISH, "u")
    authz.fail()
    assert waiting.called
    with pytest.raises(AuthFailed):
        auth.check("PUB", PUBLISH, "u")
    assert auth.login("again").called  # "AUTH already set"
    with pytest.raises(Invalid):
        auth.login("again").result.raiseException()


def test_the_credential_cache_shares_one_query_and_keeps_answers_until_their_ttl():
    clock = Clock()
    authz = ScriptedAuthorizer(clock)
    cache = CredentialCache(authz, clock, size=2)
    a, b = cache.lookup("s", "1.2.3.4", None), cache.lookup("s", "1.2.3.4", None)
    assert len(authz.queries) == 1
    authz.answer(answer(grant("t"), ttl=5))
    assert a.result.identity == b.result.identity == "app"
    assert cache.lookup("s", "1.2.3.4", None).identity == "app"  # known: no Deferred
    clock.advance(5)
    again = cache.lookup("s", "1.2.3.4", None)
    authz.fail()
    assert isinstance(again.result.value, AuthFailed)
    again.addErrback(lambda _: None)

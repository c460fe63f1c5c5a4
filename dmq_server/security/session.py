"""The one place adapters ask "may this client do that?": per TCP connection
(``ClientAuth``) and per HTTP credential (``CredentialCache``).

The NSQ and dmq adapters hold a ``ClientAuth`` when authentication is on. ``login(secret)``
asks the authorizer; ``check(verb, permission, topic, channel)`` answers at once (None:
allowed; raises ``AuthFirst``, ``NotPermitted`` or ``AuthFailed``) while the answer's ttl
holds, which is every publish on the hot path: a dictionary lookup
(``core.auth.AuthState.allows``). Once the ttl has run out it returns a Deferred instead:
the authorizer is asked again (nsqd's ``IsAuthorized`` re-query), the adapter holds that
command, and everything after it, until the Deferred fires, then runs the command again,
which now finds the new answer, or ``AuthFailed`` when the authorizer could not be asked
or refused the secret.

Every refusal is logged with the peer's address and identity; a connection refused many
times logs the first ``LOGGED_REFUSALS`` and then only a count, so one client looping on
a forbidden topic cannot flood the log.

``CredentialCache`` serves HTTP: each request carries its credential (a bearer secret, or
a verified client certificate), so answers are kept per (secret, address, TLS, certificate
name) until their ttl, and concurrent requests with one credential share one query.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, TypedDict

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from dmq_server.core.auth import AuthState
from dmq_server.core.clock import Clock
from dmq_server.core.errors import AuthFailed, AuthFirst, Invalid, NotPermitted
from dmq_server.security.authorizer import Authorizer
from dmq_server.security.tls import PeerTls

__all__ = ["AuthStats", "ClientAuth", "CredentialCache", "LOGGED_REFUSALS"]

log = Logger()

LOGGED_REFUSALS = 10


def _ask(authorizer: Authorizer, secret: str, remote_ip: str, tls: PeerTls | None) -> defer.Deferred:
    return defer.maybeDeferred(
        authorizer.query, secret, remote_ip, tls is not None, tls.proven_name if tls is not None else ""
    )


class AuthStats(TypedDict):
    """A connection's authentication, as the stats show it."""

    authed: bool
    auth_identity: str
    auth_identity_url: str


class ClientAuth:
    """One TCP connection's authentication state."""

    def __init__(self, authorizer: Authorizer, clock: Clock, remote_ip: str, peer: str, tls: Callable[[], PeerTls | None]):
        self.authorizer = authorizer
        self.clock = clock
        self.remote_ip = remote_ip
        self.peer = peer
        self.tls = tls
        self.secret: str | None = None
        self.state: AuthState | None = None
        self.failed = False
        self.refusals = 0
        self._refreshing: defer.Deferred | None = None

    @property
    def identity(self) -> str:
        return self.state.identity if self.state is not None else ""

    def login(self, secret: str) -> defer.Deferred:
        """Ask about ``secret``: fires the ``AuthState``, or fails with ``AuthFailed`` (the
        authorizer refused or could not be asked) or ``NotPermitted`` (no authorizations)."""
        if self.secret is not None:
            return defer.fail(Invalid("AUTH already set"))
        self.secret = secret
        return self._query().addCallback(self._has_grants)

    def _has_grants(self, state: AuthState) -> AuthState:
        if not state.grants:
            self._refuse("AUTH", "", "", "no authorizations")
            raise NotPermitted("AUTH no authorizations found")
        return state

    def _query(self) -> defer.Deferred:
        d = _ask(self.authorizer, self.secret or "", self.remote_ip, self.tls())

        def answered(state: AuthState) -> AuthState:
            self.state, self.failed = state, False
            log.info("{peer}: authenticated as {identity!r} ({n} authorizations, ttl {ttl}s)",
                     peer=self.peer, identity=state.identity, n=len(state.grants), ttl=state.ttl)
            return state

        def refused(failure: Failure) -> None:
            self.state, self.failed = None, True
            log.warn("{peer}: AUTH failed: {why}", peer=self.peer, why=failure.getErrorMessage())
            raise AuthFailed("AUTH failed")

        return d.addCallbacks(answered, refused)

    def check(self, verb: str, permission: str, topic: str, channel: str = "") -> defer.Deferred | None:
        """None if allowed; a Deferred (never failing) when the answer must be asked for
        again first; raises the refusal otherwise."""
        state = self.state
        if state is None:
            if self._refreshing is not None:
                return self._waiter()
            if self.failed:
                raise AuthFailed("AUTH failed")
            self._refuse(verb, topic, channel, "not authenticated")
            raise AuthFirst(f"AUTH required before {verb}")
        if state.expired(self.clock.seconds()):
            if self._refreshing is None:
                refreshing = self._query()
                refreshing.addErrback(lambda _: None)
                if refreshing.called:  # answered at once (the auth file): decide now
                    return self.check(verb, permission, topic, channel)
                self._refreshing = refreshing
                refreshing.addBoth(self._refreshed)
            return self._waiter()
        if state.allows(permission, topic, channel):
            return None
        self._refuse(verb, topic, channel, f"no {permission} permission")
        raise NotPermitted(f'AUTH failed for {verb} on "{topic}" "{channel}"')

    def allows_now(self, permission: str, topic: str, channel: str = "") -> bool:
        """Whether ``check`` would answer None (allowed) now, without its side effects
        (asking the authorizer again, counting a refusal): a run of sends from one read
        to one topic is checked once with this, and sent the one-by-one way otherwise."""
        state = self.state
        if state is None or state.expired(self.clock.seconds()):
            return False
        return state.allows(permission, topic, channel)

    def _waiter(self) -> defer.Deferred:
        waiter: defer.Deferred = defer.Deferred()
        assert self._refreshing is not None
        self._refreshing.addBoth(self._wake, waiter)
        return waiter

    @staticmethod
    def _wake(result: object, waiter: defer.Deferred) -> object:
        waiter.callback(None)
        return result

    def _refreshed(self, _: object) -> None:
        self._refreshing = None

    def _refuse(self, verb: str, topic: str, channel: str, why: str) -> None:
        self.refusals += 1
        if self.refusals <= LOGGED_REFUSALS:
            log.warn("{peer} ({identity}): refused {verb} on {topic!r} {channel!r}: {why}",
                     peer=self.peer, identity=self.identity or "unauthenticated",
                     verb=verb, topic=topic, channel=channel, why=why)
        elif self.refusals == LOGGED_REFUSALS + 1:
            log.warn("{peer}: more refusals on this connection are counted, not logged", peer=self.peer)

    def stats(self) -> AuthStats:
        return {
            "authed": self.state is not None,
            "auth_identity": self.identity,
            "auth_identity_url": self.state.identity_url if self.state is not None else "",
        }


class CredentialCache:
    """Answers for HTTP credentials, kept until their ttl; at most ``size`` of them."""

    def __init__(self, authorizer: Authorizer, clock: Clock, size: int = 4096):
        self.authorizer = authorizer
        self.clock = clock
        self.size = size
        self._states: OrderedDict[tuple, AuthState] = OrderedDict()
        self._pending: dict[tuple, list[defer.Deferred]] = {}

    def lookup(self, secret: str, remote_ip: str, tls: PeerTls | None) -> AuthState | defer.Deferred:
        """The answer now if known and fresh, else a Deferred of it (fails AuthFailed)."""
        key = (secret, remote_ip, tls is not None, tls.proven_name if tls is not None else "")
        state = self._states.get(key)
        if state is not None and not state.expired(self.clock.seconds()):
            return state
        self._states.pop(key, None)
        waiter: defer.Deferred = defer.Deferred()
        waiting = self._pending.get(key)
        if waiting is not None:
            waiting.append(waiter)
            return waiter
        self._pending[key] = [waiter]

        def done(result: AuthState | Failure) -> None:
            waiters = self._pending.pop(key)
            if isinstance(result, AuthState):
                self._states[key] = result
                while len(self._states) > self.size:
                    self._states.popitem(last=False)
                for w in waiters:
                    w.callback(result)
                return
            log.warn("HTTP credential from {ip} refused: {why}", ip=remote_ip, why=result.getErrorMessage())
            for w in waiters:
                w.errback(AuthFailed("credential refused"))

        _ask(self.authorizer, secret, remote_ip, tls).addBoth(done)
        return waiter

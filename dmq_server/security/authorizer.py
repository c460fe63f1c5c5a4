"""Where a secret is checked: nsqd's auth servers, or the ``--auth-file``.

Both answer ``query(secret, remote_ip, tls, common_name)`` with a Deferred firing an
``AuthState`` (``dmq_server.core.auth``), or failing with ``AuthFailed`` whose reason
is for the log only (nsqd does not tell untrusted clients why).

``HttpAuthorizer`` asks ``--auth-http-address`` as nsqd does
(``internal/auth/authorizations.go``): a random one first, then the next until one
answers; ``GET http://ADDRESS/auth?remote_ip=&tls=&secret=&common_name=`` (an address
with ``://`` is used as the whole URL; ``--auth-http-request-method post`` sends the same
fields as a form); status 200 and a valid answer, within the connect and request
timeouts (the request timeout covers the whole exchange, the answer's body included, as
Go's ``http.Client.Timeout`` does). Over https the auth server's certificate is verified
against ``--tls-root-ca-file`` when given, else the system's CAs.

The answer is read as Go's client, nsqd's, reads it: to its ``Content-Length``, to its
last chunk, or, when it declares neither (HTTP/1.0, e.g. an auth server written on
Python's ``http.server``), to the close of the connection, which is then its end (Twisted's
``readBody`` calls that a partial download). A body cut short of what it declared is a
failure, and no more than ``MAX_ANSWER`` bytes are held: a larger answer is refused and its
connection closed. Every failure is logged with what went wrong (cannot connect, no answer
within the timeout, the status, a body cut short, not JSON...); the client hears nsqd's
``E_AUTH_FAILED`` only.

``FileAuthorizer`` answers from a file read at start and again on SIGHUP (a file that
no longer parses keeps the previous one, and the reload says why).
"""

from __future__ import annotations

import random
from io import BytesIO
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Generator, Protocol, cast
from urllib.parse import urlencode

from twisted.internet import defer
from twisted.internet.error import ConnectError, TimeoutError as ConnectTimeout
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Protocol as TwistedProtocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import Agent, BrowserLikePolicyForHTTPS, FileBodyProducer, ResponseDone, ResponseFailed
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer

from dmq_server.core.auth import AnswerError, AuthFile, AuthState, parse_answer, parse_auth_file
from dmq_server.core.clock import Clock
from dmq_server.core.errors import AuthFailed
from dmq_server.core.options import Options

if TYPE_CHECKING:  # pyOpenSSL is imported only when a root CA is given
    from twisted.internet.ssl import Certificate

__all__ = ["Authorizer", "HttpAuthorizer", "FileAuthorizer", "make_authorizer", "read_answer"]

log = Logger()

#: most bytes of an auth server's answer read (an answer is a few hundred bytes)
MAX_ANSWER = 1 << 20


class Authorizer(Protocol):
    """What the sessions ask of either authorizer (``typing.Protocol``: the two classes
    below satisfy it by shape)."""

    def query(self, secret: str, remote_ip: str, tls: bool, common_name: str) -> defer.Deferred: ...

    def reload(self) -> str | None: ...


class ResponseBody(Protocol):
    """What ``read_answer`` uses of Twisted's ``IResponse`` (a zope interface, which the
    type checker cannot match by shape): the declared length (``UNKNOWN_LENGTH`` when
    there is none), and the body delivered to a protocol."""

    @property
    def length(self) -> int | str: ...  # str: UNKNOWN_LENGTH

    def deliverBody(self, protocol: TwistedProtocol) -> None: ...


class _Response(ResponseBody, Protocol):
    """An auth server's whole answer: its status as well as its body."""

    @property
    def code(self) -> int: ...

    @property
    def phrase(self) -> bytes: ...


class FileAuthorizer:
    """Answers from ``--auth-file`` (``core.auth.parse_auth_file`` describes it)."""

    def __init__(self, path: str, clock: Clock):
        self.path = path
        self.clock = clock
        self._file = self._read()

    def _read(self) -> AuthFile:
        try:
            text = Path(self.path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise AnswerError(f"{self.path}: cannot read: {exc}") from None
        return parse_auth_file(text, self.path)

    def reload(self) -> str | None:
        try:
            self._file = self._read()
        except AnswerError as exc:
            log.error("auth file reload failed, keeping the previous one: {why}", why=exc)
            return str(exc)
        log.info("auth file {path} re-read", path=self.path)
        return None

    def query(self, secret: str, remote_ip: str, tls: bool, common_name: str) -> defer.Deferred:
        state = self._file.answer(secret, common_name, self.clock.seconds())
        if state is None:
            what = "secret" if secret else f"certificate name {common_name!r}" if common_name else "credential"
            return defer.fail(AuthFailed(f"unknown {what} (auth file)"))
        return defer.succeed(state)


class HttpAuthorizer:
    """nsqd's auth-server client."""

    def __init__(self, reactor: Clock, addresses: tuple[str, ...], method: str = "get",
                 connect_timeout: float = 2.0, request_timeout: float = 5.0, root_ca: str = ""):
        self.reactor = reactor
        self.addresses = addresses
        self.method = method.upper().encode()
        self.request_timeout = request_timeout
        policy = BrowserLikePolicyForHTTPS(_trust_root(root_ca)) if root_ca else BrowserLikePolicyForHTTPS()
        self.agent = Agent(reactor, contextFactory=policy, connectTimeout=connect_timeout)
        self.queries = 0

    def reload(self) -> str | None:
        return None

    def url(self, address: str) -> str:
        return address if "://" in address else f"http://{address}/auth"

    @defer.inlineCallbacks
    def query(self, secret: str, remote_ip: str, tls: bool, common_name: str) -> Generator[defer.Deferred, AuthState, AuthState]:
        fields = {"remote_ip": remote_ip, "tls": "true" if tls else "false", "secret": secret, "common_name": common_name}
        start = random.randrange(len(self.addresses))
        reasons = []
        for i in range(len(self.addresses)):
            address = self.addresses[(start + i) % len(self.addresses)]
            try:
                state = yield self._ask(self.url(address), fields)
            except Exception as exc:  # one server failing is a reason to try the next
                log.warn("auth server {url} failed: {why}", url=self.url(address), why=exc)
                reasons.append(f"{address}: {exc}")
                continue
            return state
        raise AuthFailed("; ".join(reasons) or "no auth server")

    def _ask(self, url: str, fields: dict[str, str]) -> defer.Deferred:
        """The answer's ``AuthState``, or a failure whose message says what went wrong."""
        self.queries += 1
        timeout = self.request_timeout

        def timed_out(result: object, _: float) -> None:
            raise AnswerError(f"no answer within {timeout:g} s (--http-client-request-timeout)")

        d = self._exchange(url, fields)
        # IReactorTime is a zope interface, nominal to mypy; the reactor and task.Clock provide it
        d.addTimeout(timeout, cast(IReactorTime, self.reactor), onTimeoutCancel=timed_out)
        return d.addErrback(_explain)

    def _exchange(self, url: str, fields: dict[str, str]) -> defer.Deferred:
        query = urlencode(fields)
        headers = Headers({b"accept": [b"application/json"]})
        body: IBodyProducer | None = None
        if self.method == b"POST":
            headers.addRawHeader(b"content-type", b"application/x-www-form-urlencoded")
            # IBodyProducer is a zope interface, nominal to mypy; FileBodyProducer provides it
            body = cast(IBodyProducer, FileBodyProducer(BytesIO(query.encode())))
        else:
            url = f"{url}{'&' if '?' in url else '?'}{query}"
        return self.agent.request(self.method, url.encode(), headers, body).addCallback(self._answered)

    def _answered(self, response: _Response) -> defer.Deferred:
        def parsed(data: bytes) -> AuthState:
            if response.code != 200:
                phrase = response.phrase.decode("latin-1", "replace")
                raise AnswerError(f"status {response.code} {phrase}: {data[:200]!r}")
            return parse_answer(data, self.reactor.seconds())

        return read_answer(response).addCallback(parsed)


def read_answer(response: ResponseBody, limit: int = MAX_ANSWER) -> defer.Deferred:
    """The whole body of an auth server's ``response`` (bytes), or an ``AnswerError``."""
    length = response.length
    declared = length if isinstance(length, int) else None  # else UNKNOWN_LENGTH
    reader = _AnswerBody(limit, declared)
    response.deliverBody(reader)
    return reader.done


class _AnswerBody(TwistedProtocol):
    """Collects a body up to ``limit`` bytes. Twisted ends a body with ``ResponseDone``
    (its Content-Length or last chunk reached), ``PotentialDataLoss`` (the connection
    closed, and the response declared neither a length nor chunks: that close is its end,
    the body is whole) or a failure (a declared length or a chunked body cut short: the
    chunked decoder's ``_DataLoss``; Twisted keeps ``Transfer-Encoding`` to itself, so a
    chunked body is told from a close-ended one only by how it fails)."""

    def __init__(self, limit: int, declared: int | None):
        self.limit, self.declared = limit, declared
        self.parts: list[bytes] = []
        self.size = 0
        self.done: defer.Deferred = defer.Deferred(self._cancel)
        self._waiting = True

    def connectionMade(self) -> None:
        if self.declared is not None and self.declared > self.limit:
            self._fail(f"an answer of {self.declared} bytes (Content-Length), over the limit of {self.limit}")

    def dataReceived(self, data: bytes) -> None:
        if not self._waiting:
            return
        self.size += len(data)
        if self.size > self.limit:
            self._fail(f"an answer over the limit of {self.limit} bytes (not read further)")
            return
        self.parts.append(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if not self._waiting:
            return
        self._waiting = False
        if reason.check(ResponseDone) or (reason.check(PotentialDataLoss) and self.declared is None):
            self.done.callback(b"".join(self.parts))
        elif self.declared is not None:
            self.done.errback(AnswerError(f"the answer ended after {self.size} of the {self.declared} bytes "
                                          "its Content-Length declared"))
        else:
            self.done.errback(AnswerError(f"the answer ended after {self.size} bytes, short of its end: "
                                          f"{_reasons(reason)}"))

    def _fail(self, why: str) -> None:
        self._waiting = False
        self.parts = []
        self._abort()
        self.done.errback(AnswerError(why))

    def _cancel(self, _: defer.Deferred) -> None:
        self._waiting = False
        self._abort()

    def _abort(self) -> None:
        # the body's transport is Twisted's TransportProxyProducer (it stops producing by
        # closing the connection), or a test's transport that can abort
        abort: Callable[[], object] | None = getattr(self.transport, "abortConnection", None)
        if abort is None:
            abort = getattr(self.transport, "stopProducing")
        abort()


def _explain(failure: Failure) -> None:
    """Raise what went wrong as an ``AnswerError`` a person can act on."""
    error = failure.value
    if isinstance(error, AnswerError):
        failure.raiseException()
    if isinstance(error, ConnectTimeout):
        raise AnswerError(f"cannot connect within the connect timeout (--http-client-connect-timeout): {error}")
    if isinstance(error, ConnectError):
        raise AnswerError(f"cannot connect: {error}")
    if isinstance(error, ResponseFailed):
        raise AnswerError(f"no valid HTTP answer: {_reasons(failure)}")
    failure.raiseException()


def _reasons(failure: Failure) -> str:
    """The message of a failure, or of each failure a ``ResponseFailed`` wraps."""
    error = failure.value
    nested = getattr(error, "reasons", None)
    if isinstance(error, ResponseFailed) and nested:
        return "; ".join(f"{type(r.value).__name__}: {r.getErrorMessage()}" for r in nested)
    return f"{type(error).__name__}: {failure.getErrorMessage()}"


def _trust_root(path: str) -> Certificate:
    from twisted.internet.ssl import Certificate

    return Certificate.loadPEM(Path(path).read_bytes())


def make_authorizer(options: Options, reactor: Clock) -> Authorizer | None:
    """The authorizer the options name (None: authentication is off)."""
    if options.auth_file:
        return FileAuthorizer(options.auth_file, reactor)
    if options.auth_http_addresses:
        return HttpAuthorizer(
            reactor,
            options.auth_http_addresses,
            options.auth_http_request_method,
            options.http_client_connect_timeout,
            options.http_client_request_timeout,
            options.tls_root_ca_file,
        )
    return None

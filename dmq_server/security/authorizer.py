"""Where a secret is checked: nsqd's auth servers, or the ``--auth-file``.

Both answer ``query(secret, remote_ip, tls, common_name)`` with a Deferred firing an
``AuthState`` (``dmq_server.core.auth``), or failing with ``AuthFailed`` whose reason
is for the log only (nsqd does not tell untrusted clients why).

``HttpAuthorizer`` asks ``--auth-http-address`` as nsqd does
(``internal/auth/authorizations.go``): a random one first, then the next until one
answers; ``GET http://ADDRESS/auth?remote_ip=&tls=&secret=&common_name=`` (an address
with ``://`` is used as the whole URL; ``--auth-http-request-method post`` sends the same
fields as a form); status 200 and a valid answer, within the connect and request
timeouts. Over https the auth server's certificate is verified against
``--tls-root-ca-file`` when given, else the system's CAs.

``FileAuthorizer`` answers from a file read at start and again on SIGHUP (a file that
no longer parses keeps the previous one, and the reload says why).
"""

from __future__ import annotations

import random
from io import BytesIO
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlencode

from twisted.internet import defer
from twisted.logger import Logger
from twisted.web.client import Agent, BrowserLikePolicyForHTTPS, FileBodyProducer, readBody
from twisted.web.http_headers import Headers

from dmq_server.core.auth import AnswerError, AuthFile, AuthState, parse_answer, parse_auth_file
from dmq_server.core.errors import AuthFailed

__all__ = ["Authorizer", "HttpAuthorizer", "FileAuthorizer", "make_authorizer"]

log = Logger()

#: most bytes of an auth server's answer read (an answer is a few hundred bytes)
MAX_ANSWER = 1 << 20


class Authorizer(Protocol):
    def query(self, secret: str, remote_ip: str, tls: bool, common_name: str) -> defer.Deferred: ...

    def reload(self) -> str | None: ...


class FileAuthorizer:
    """Answers from ``--auth-file`` (``core.auth.parse_auth_file`` describes it)."""

    def __init__(self, path: str, clock: Any):
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

    def __init__(self, reactor: Any, addresses: tuple[str, ...], method: str = "get",
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
    def query(self, secret: str, remote_ip: str, tls: bool, common_name: str) -> Any:
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

    @defer.inlineCallbacks
    def _ask(self, url: str, fields: dict[str, str]) -> Any:
        self.queries += 1
        query = urlencode(fields)
        headers = Headers({b"accept": [b"application/json"]})
        body = None
        if self.method == b"POST":
            headers.addRawHeader(b"content-type", b"application/x-www-form-urlencoded")
            body = FileBodyProducer(BytesIO(query.encode()))
        else:
            url = f"{url}{'&' if '?' in url else '?'}{query}"
        d = self.agent.request(self.method, url.encode(), headers, body)
        d.addTimeout(self.request_timeout, self.reactor)
        response = yield d
        read = readBody(response)
        read.addTimeout(self.request_timeout, self.reactor)
        data = yield read
        if response.code != 200:
            raise AnswerError(f"status {response.code}")
        if len(data) > MAX_ANSWER:
            raise AnswerError(f"answer of {len(data)} bytes")
        state: AuthState = parse_answer(data, self.reactor.seconds())
        return state


def _trust_root(path: str) -> Any:
    from twisted.internet.ssl import Certificate

    return Certificate.loadPEM(Path(path).read_bytes())


def make_authorizer(options: Any, reactor: Any) -> Authorizer | None:
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

"""Every request on an HTTP listener passes here before its resource renders: TLS, the
Host, cross-site protection and authorization, in this order, written once.

1. ``/ping`` is always open (load balancers, the test harness, ``dmq-server`` itself), and
   so are the web console's static files (``/console``: no data, the API calls carry it).
2. **TLS required** (``--tls-required true``): the plaintext listener answers everything
   else ``403 {"message": "TLS_REQUIRED", "https_port": N}``, nsqd's answer, which the Go
   tools follow to the HTTPS port.
3. **The Host** (no authentication, a loopback listener): a request naming a host other
   than a loopback one or ``--broadcast-address`` is refused: a web page whose name was
   rebound to 127.0.0.1 (DNS rebinding) would otherwise be same-origin with this port.
4. **Requests from another origin** (every method but GET, HEAD and OPTIONS), decided as
   Go 1.25's ``net/http.CrossOriginProtection`` decides, from what browsers add to every
   request and a page cannot forge: when ``Sec-Fetch-Site`` is present, only ``same-origin``
   (a page of this listener) and ``none`` (the user: a typed URL, a bookmark) pass, and
   ``cross-site``, ``same-site`` (another port or subdomain) or anything else is refused;
   without it (an older browser, or a plain-HTTP origin that is not loopback: browsers send
   Fetch metadata to trustworthy origins only), an ``Origin`` must be this listener's own,
   ``scheme://Host``. A request with neither header comes from no browser (browsers send
   ``Origin`` with every POST a page makes): curl, urllib, nsqadmin, client libraries; it
   passes whatever its body's type, as nsqd's API expects
   (``tests/integration/test_security_browser.py`` tries both sides, with Chromium).
5. **Authorization.** Without authentication (no ``--auth-file``/``--auth-http-address``)
   only the admin API is guarded, by ``http.access.authorize`` (the admin token and the
   listener's address). With it, a request needs a
   credential: ``Authorization: Bearer SECRET`` (asked of the same authorizer as AUTH, the
   answer kept until its ttl: ``security.session.CredentialCache``) or, over HTTPS, a
   client certificate verified against ``--tls-root-ca-file`` (asked with an empty secret
   and its common name). ``/pub`` and ``/mpub`` need ``publish`` on the topic; ``/topic/*``
   and ``/channel/*`` and the admin API need ``admin`` on the topic and channel they name
   (``""`` for an operation on no topic); reads need an identity, or nothing with
   ``--http-open-reads`` (the admin API's reads still need ``admin``). ``--admin-token``
   still opens the admin API. No credential: 401; not allowed: 403 ``E_UNAUTHORIZED``. What
   the guard granted on the admin API it leaves on the request (``http.access.GRANTED``),
   so ``authorize`` does not decide again, and the audit log names the identity.

Refusals are logged with the peer's address, the identity when known, and the reason.
Answers follow the path's convention: the admin API's ``{"error", "message"}``, nsqd's
``{"message"}`` elsewhere.
"""

from __future__ import annotations

import json
from typing import Callable
from urllib.parse import parse_qs, urlsplit

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from twisted.web.server import Request

from dmq_server.core.auth import ADMIN, PUBLISH, AuthState
from dmq_server.core.peers import is_loopback
from dmq_server.http.access import GRANTED, Access, actor_of
from dmq_server.security.session import CredentialCache
from dmq_server.security.tls import ServerTls, peer_tls

__all__ = ["HttpGuard", "classify", "cross_origin_refusal", "READ", "OPEN"]

log = Logger()

OPEN, READ = "open", "read"
_SAFE_METHODS = (b"GET", b"HEAD", b"OPTIONS")
#: Sec-Fetch-Site of a request a page of this origin sent, or the user (a typed URL, a bookmark)
_OWN_FETCH_SITES = ("same-origin", "none")
#: who sent a request, by its Sec-Fetch-Site, for the refusal's message
_FOREIGN_FETCH_SITES = {
    "cross-site": "a page of another site",
    "same-site": "a page of another origin on the same site (another port or subdomain)",
}
_LOOPBACK_NAMES = ("localhost",)


def classify(method: bytes, path: bytes, query: str) -> tuple[str, str, str]:
    """``(what, topic, channel)`` a request needs: OPEN, READ, or a permission."""
    params = parse_qs(query, keep_blank_values=True)

    def param(name: str) -> str:
        values = params.get(name)
        return values[0] if values else ""

    parts = [p for p in path.decode("latin-1").split("/") if p]
    if parts == ["ping"] or (parts[:1] == ["console"] and method in _SAFE_METHODS):
        return OPEN, "", ""
    if parts[:1] == ["admin"]:
        if len(parts) >= 4 and parts[1] == "channels":
            return ADMIN, parts[2], parts[3]
        return ADMIN, param("topic"), param("channel")
    if method in _SAFE_METHODS:
        return READ, "", ""
    if parts in (["pub"], ["mpub"]):
        return PUBLISH, param("topic"), ""
    if parts[:1] in (["topic"], ["channel"]):
        return ADMIN, param("topic"), param("channel")
    return ADMIN, "", ""


def cross_origin_refusal(
    method: bytes, fetch_site: str | None, origin: str | None, own_origin: str | None
) -> str | None:
    """Why a state-changing request was sent by a page of another origin (None: it was
    not, or no browser sent it). ``own_origin`` is this listener's ``scheme://host[:port]``
    (None: the request named no Host). Fetch metadata decides where the browser sent it,
    since it also tells the user's own navigation (``none``) from a page's; ``Origin`` is
    the fallback, compared whole, as Go compares it with the Host."""
    if method in _SAFE_METHODS:
        return None
    if fetch_site is not None:
        site = fetch_site.strip().lower()
        if site in _OWN_FETCH_SITES:
            return None
        if site in _FOREIGN_FETCH_SITES:
            return (f"{_FOREIGN_FETCH_SITES[site]} sent this change (Sec-Fetch-Site: {fetch_site}); "
                    "only this listener's own pages may")
        return f"Sec-Fetch-Site: {fetch_site}: a browser's request neither same-origin nor the user's own (none)"
    if origin is None:
        return None
    given = origin.strip().lower()
    if given == "null":
        return ("a page of an opaque origin sent this change (Origin: null: a sandboxed frame, a local file, "
                "or a redirect from another origin)")
    if own_origin is None:
        return f"Origin {origin} came without a Host header to compare it with"
    if given != own_origin:
        return f"a page of {origin} sent this change (Origin), not one of this listener's {own_origin}"
    return None


class _Refusal(Resource):
    isLeaf = True

    def __init__(self, status: int, code: str, message: str, admin: bool, extra: dict | None = None):
        super().__init__()
        self.status, self.code, self.message, self.admin, self.extra = status, code, message, admin, extra or {}

    def render(self, request: Request) -> bytes:
        request.setResponseCode(self.status)
        request.setHeader(b"content-type", b"application/json; charset=utf-8")
        if self.status == 401:
            request.setHeader(b"www-authenticate", b'Bearer realm="dmq"')
        if self.admin:
            payload = {"error": self.code, "message": self.message}
        else:
            request.setHeader(b"x-nsq-content-type", b"nsq; version=1.0")
            payload = {"message": f"{self.code} {self.message}".strip(), **self.extra}
        return json.dumps(payload).encode() + b"\n"


class _AfterAuth(Resource):
    """Renders the resource once the authorizer answered (or a refusal)."""

    isLeaf = True

    def __init__(self, waiting: defer.Deferred):
        super().__init__()
        self.waiting = waiting

    def render(self, request: Request) -> int:
        gone = [False]
        request.notifyFinish().addErrback(lambda _: gone.__setitem__(0, True))

        def render(resource: Resource) -> None:
            if gone[0]:
                return
            body = resource.render(request)
            if body is not NOT_DONE_YET:
                request.write(body)
                request.finish()

        self.waiting.addCallback(render).addErrback(lambda f: log.failure("HTTP authorization failed", f))
        return NOT_DONE_YET


class HttpGuard:
    """The checks of one listener (plaintext or HTTPS)."""

    def __init__(
        self,
        *,
        listen_host: str,
        secure: bool = False,
        server_tls: ServerTls | None = None,
        tls_required: bool = False,
        https_port: Callable[[], int | None] = lambda: None,
        credentials: CredentialCache | None = None,
        admin_token: str = "",
        open_reads: bool = False,
        broadcast_address: str = "",
    ):
        self.listen_host = listen_host
        self.secure = secure
        self.server_tls = server_tls
        self.tls_required = tls_required and not secure
        self.https_port = https_port
        self.credentials = credentials
        self.admin_token = admin_token
        self.open_reads = open_reads
        self.check_host = credentials is None and is_loopback(listen_host)
        self.hosts = {h.lower() for h in (*_LOOPBACK_NAMES, broadcast_address) if h}

    # -- the steps --------------------------------------------------------------------
    def resource_for(self, request: Request, resource: Resource) -> Resource:
        path = request.path
        query = urlsplit(request.uri.decode("latin-1")).query
        what, topic, channel = classify(request.method, path, query)
        admin = path == b"/admin" or path.startswith(b"/admin/")
        if what == OPEN:
            return resource
        if self.tls_required:
            return _Refusal(403, "TLS_REQUIRED", "", False, {"message": "TLS_REQUIRED", "https_port": self.https_port()})
        host = _host_of(request.getHeader(b"host"))
        if self.check_host and host is not None and not self._local_host(host):
            return self._refuse(request, 403, "E_HOST", f"host {host!r} is not this loopback listener's", admin)
        tls = peer_tls(request.channel.transport, self.server_tls) if self.secure else None
        bearer = _bearer(request)
        why = cross_origin_refusal(request.method, _text(request.getHeader(b"sec-fetch-site")),
                                   _text(request.getHeader(b"origin")), self._own_origin(request))
        if why is not None:
            return self._refuse(request, 403, "E_CROSS_SITE", why, admin)
        if self.credentials is None:
            return resource  # the admin API's own rule decides (http.access.authorize)
        if admin and self.admin_token:
            given = bearer or _text(request.getHeader(b"x-dmq-admin-token"))
            if given is not None and _same(given, self.admin_token):
                setattr(request, GRANTED, Access(actor_of(request), admin=True))
                return resource
        if what == READ and self.open_reads:
            return resource
        if bearer is None and not (tls and tls.proven_name):
            return self._refuse(request, 401, "E_AUTH_FIRST", "a credential is needed (Authorization: Bearer SECRET "
                                "or a client certificate)", admin)
        remote_ip = getattr(request.getClientAddress(), "host", "")
        found = self.credentials.lookup(bearer or "", remote_ip, tls)
        decide = lambda state: self._decide(request, resource, state, what, topic, channel, admin)  # noqa: E731
        if isinstance(found, AuthState):
            return decide(found)

        def refused(failure: Failure) -> Resource:
            return self._refuse(request, 401, "E_AUTH_FAILED", "credential refused", admin)

        return _AfterAuth(found.addCallbacks(decide, refused))

    def _decide(self, request: Request, resource: Resource, state: AuthState, what: str, topic: str, channel: str,
                admin: bool) -> Resource:
        if what == READ and state.grants:
            return resource
        if what != READ and state.allows(what, topic, channel):
            if admin:
                setattr(request, GRANTED, Access(f"{state.identity or '?'}@{actor_of(request)}", admin=True))
            return resource
        why = f"{state.identity or 'this credential'} may not {what} on {topic!r} {channel!r}"
        return self._refuse(request, 403, "E_UNAUTHORIZED", why, admin, state.identity)

    def _refuse(self, request: Request, status: int, code: str, why: str, admin: bool, identity: str = "") -> Resource:
        peer = request.getClientAddress()
        log.warn("HTTP {method} {path} from {peer}{who}: refused {status} {code} {why}",
                 method=_text(request.method), path=_text(request.path),
                 peer=f"{getattr(peer, 'host', '?')}:{getattr(peer, 'port', '?')}",
                 who=f" ({identity})" if identity else "", status=status, code=code, why=why)
        return _Refusal(status, code, why, admin)

    # -- helpers ---------------------------------------------------------------------
    def _own_origin(self, request: Request) -> str | None:
        host = _text(request.getHeader(b"host"))
        if not host:
            return None
        return f"{'https' if self.secure else 'http'}://{host.strip().lower()}"

    def _local_host(self, host: str) -> bool:
        host = host.lower()
        return host in self.hosts or host.endswith(".localhost") or is_loopback(host)


def _text(raw: bytes | None) -> str | None:
    return raw.decode("latin-1") if raw is not None else None


def _host_of(header: bytes | None) -> str | None:
    """The host of a Host header (``[::1]:4151`` gives ``::1``)."""
    if not header:
        return None
    text = header.decode("latin-1").strip()
    if text.startswith("["):
        return text[1:].split("]", 1)[0]
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def _bearer(request: Request) -> str | None:
    header = request.getHeader(b"authorization")
    if not header:
        return None
    scheme, _, value = header.decode("latin-1").partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def _same(given: str, expected: str) -> bool:
    import hmac

    return hmac.compare_digest(given.encode(), expected.encode())

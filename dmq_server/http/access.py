"""Who may do what on the HTTP admin surfaces (the JSON admin API and the web console): the
one place it is decided, so that real authentication (issue 16) replaces one function.

Today's rights, from the admin token (``--admin-token``) and where the port listens:

==================  ==============================  ==================================
listener            no credential                   the admin token
==================  ==============================  ==================================
loopback            read; change only without a     read and change
                    configured token
other address       nothing (no token configured:   read and change
                    nothing at all)
==================  ==============================  ==================================

and an ``Origin`` header, when the browser sends one, must be this port's own, on reads
too (a page elsewhere has no business reading bodies out of dead letters, even where CORS
would stop it seeing the answer).

A change a page on another site makes the operator's browser send (replay or delete dead
letters: cross-site request forgery) is refused before this, on every path of the port, by
``http.guard`` (Fetch metadata, as Go's ``CrossOriginProtection``). So no header is asked of
a change here: curl and scripts need only the token, where one is configured.

With authentication on (``--auth-file``, ``--auth-http-address``), ``http.guard`` has
decided already, before any resource (a credential with the ``admin`` permission, or the
admin token), and left its ``Access`` on the request (attribute ``GRANTED``), which
``authorize`` returns as it is.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from urllib.parse import urlsplit

from dmq_server.admin.operations import is_loopback
from dmq_server.core.errors import Forbidden, Unauthorized
from twisted.web.server import Request

__all__ = ["Access", "authorize", "actor_of", "SAFE_METHODS", "GRANTED"]

SAFE_METHODS = (b"GET", b"HEAD")
#: the request attribute where http.guard leaves what authentication granted
GRANTED = "dmq_granted_access"


@dataclass(frozen=True)
class Access:
    """What this request may do, and who it is for the audit log."""

    actor: str
    admin: bool


def _header(request: Request, name: bytes) -> str | None:
    value = request.getHeader(name)
    return None if value is None else value.decode("latin-1")


def given_token(request: Request) -> str | None:
    header = _header(request, b"authorization")
    if header:
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "bearer":
            return value.strip()
    return _header(request, b"x-dmq-admin-token")


def _same_origin(request: Request, origin: str) -> bool:
    parts = urlsplit(origin)
    host = _header(request, b"host")
    return parts.scheme in ("http", "https") and host is not None and parts.netloc.lower() == host.lower()


def actor_of(request: Request) -> str:
    peer = request.getClientAddress()
    return f"{getattr(peer, 'host', '?')}:{getattr(peer, 'port', '?')}"


def authorize(request: Request, listen_host: str, token: str) -> Access:
    """The request's rights, or ``Unauthorized`` / ``Forbidden`` (E_AUTH) saying why not."""
    granted = getattr(request, GRANTED, None)
    if granted is not None:
        return granted
    actor = actor_of(request)
    origin = _header(request, b"origin")
    if origin is not None and origin != "null" and not _same_origin(request, origin):
        raise Forbidden(f"requests from another origin ({origin}) are refused")
    if origin == "null":
        raise Forbidden("requests from an opaque origin are refused")
    changes = request.method not in SAFE_METHODS
    given = given_token(request)
    if token:
        if given is not None:
            if not hmac.compare_digest(given.encode(), token.encode()):
                raise Unauthorized("wrong admin token")
            return Access(actor, admin=True)
        if not is_loopback(listen_host):
            raise Unauthorized("this admin surface needs a token (Authorization: Bearer TOKEN)")
        if changes:
            raise Unauthorized("changes need the admin token (Authorization: Bearer TOKEN); without it "
                               "this surface is read-only")
        return Access(actor, admin=False)
    if not is_loopback(listen_host):
        raise Forbidden(f"admin surfaces listening on non-loopback address {listen_host} need --admin-token")
    return Access(actor, admin=True)

"""TLS for every listener: one server context, re-read on SIGHUP, and what a peer proved.

``ServerTls`` is the context factory (Twisted's ``getContext``) of the TLS-only TCP port,
the HTTPS port and NSQ's in-band ``tls_v1`` upgrade. It is built from nsqd's options:
``--tls-cert`` and ``--tls-key`` (a PEM chain and its key), ``--tls-root-ca-file`` (the CAs
client certificates are verified against), ``--tls-client-auth-policy`` and
``--tls-min-version``. The pyOpenSSL context is built here rather than through Twisted's
``CertificateOptions`` because nsqd's ``require`` policy (a certificate is required, any
certificate) is not something ``CertificateOptions`` can say.

``reload()`` builds a new context from the files; connections made afterwards use it,
connections already open keep the one they started with (an OpenSSL connection holds its
own reference), so a certificate rotated on SIGHUP drops nobody. A reload that fails keeps
the old context and says why.

``peer_tls(transport)`` reads what a connection negotiated, for AUTH's ``tls`` and
``common_name``, ``/stats`` and logs. A certificate name counts as proven (``verified``)
only when OpenSSL verified the certificate: with ``require`` any certificate is accepted,
so its name is not passed to the authorizer (nsqd passes it anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from OpenSSL import SSL
from OpenSSL.crypto import X509
from twisted.internet.interfaces import IOpenSSLContextFactory, ISSLTransport
from twisted.logger import Logger
from zope.interface import implementer
from dmq_server.core.options import Options

__all__ = ["ServerTls", "PeerTls", "peer_tls", "TlsConfigError"]

log = Logger()

_VERSIONS = {
    "tls1.0": SSL.TLS1_VERSION,
    "tls1.1": SSL.TLS1_1_VERSION,
    "tls1.2": SSL.TLS1_2_VERSION,
    "tls1.3": SSL.TLS1_3_VERSION,
}
#: the policies under which a presented certificate has been verified by OpenSSL
_VERIFYING = ("require-verify", "verify-if-given")


class TlsConfigError(ValueError):
    """The certificate, key or CA files cannot make a TLS context."""


@dataclass(frozen=True)
class PeerTls:
    """What a TLS connection negotiated and what its peer proved."""

    version: str
    cipher: str
    common_name: str  # of the client certificate; "" without one
    verified: bool  # the certificate was verified against --tls-root-ca-file

    @property
    def proven_name(self) -> str:
        """The certificate's name if it can be trusted, else ""."""
        return self.common_name if self.verified else ""


@implementer(IOpenSSLContextFactory)
class ServerTls:
    """The server side of TLS for every listener; ``getContext()`` is Twisted's
    ``IOpenSSLContextFactory``."""

    def __init__(self, cert: str, key: str, root_ca: str = "", policy: str = "", min_version: str = "tls1.2"):
        self.cert, self.key, self.root_ca = cert, key, root_ca
        self.policy, self.min_version = policy, min_version
        self.reloads = 0
        self._context = self._build()

    @classmethod
    def from_options(cls, options: Options) -> "ServerTls | None":
        if not options.tls_enabled:
            return None
        return cls(
            options.tls_cert,
            options.tls_key,
            options.tls_root_ca_file,
            options.tls_client_auth_policy,
            options.tls_min_version,
        )

    @property
    def verifies_clients(self) -> bool:
        return self.policy in _VERIFYING

    def getContext(self) -> SSL.Context:
        return self._context

    def reload(self) -> str | None:
        """Build the context again from the files; on failure keep the current one and
        return the reason."""
        try:
            context = self._build()
        except TlsConfigError as exc:
            log.error("TLS: certificate reload failed, keeping the current one: {why}", why=exc)
            return str(exc)
        self._context = context
        self.reloads += 1
        log.info("TLS: certificate and key re-read from {cert}", cert=self.cert)
        return None

    def _build(self) -> SSL.Context:
        ctx = SSL.Context(SSL.TLS_SERVER_METHOD)
        ctx.set_min_proto_version(_VERSIONS[self.min_version])
        # no compression (CRIME), no renegotiation (a client could make the server do
        # handshakes for ever), the server's cipher order
        ctx.set_options(SSL.OP_NO_COMPRESSION | SSL.OP_CIPHER_SERVER_PREFERENCE | SSL.OP_NO_RENEGOTIATION)
        try:
            ctx.use_certificate_chain_file(self.cert)
            ctx.use_privatekey_file(self.key)
            ctx.check_privatekey()
            if self.root_ca:
                ctx.load_verify_locations(self.root_ca)
        except (SSL.Error, OSError) as exc:
            raise TlsConfigError(f"cannot use {self.cert} / {self.key} / {self.root_ca or '(no CA)'}: {_why(exc)}") from None
        # sessions are resumed only within this server's own contexts
        ctx.set_session_id(b"dmq")
        if self.policy == "require-verify":
            ctx.set_verify(SSL.VERIFY_PEER | SSL.VERIFY_FAIL_IF_NO_PEER_CERT, _keep_verdict)
        elif self.policy == "verify-if-given":
            ctx.set_verify(SSL.VERIFY_PEER, _keep_verdict)
        elif self.policy == "require":
            ctx.set_verify(SSL.VERIFY_PEER | SSL.VERIFY_FAIL_IF_NO_PEER_CERT, _accept_any)
        return ctx


def _keep_verdict(conn: SSL.Connection, cert: X509, errno: int, depth: int, ok: int) -> bool:
    return bool(ok)


def _accept_any(conn: SSL.Connection, cert: X509, errno: int, depth: int, ok: int) -> bool:
    return True


def _why(exc: BaseException) -> str:
    if isinstance(exc, SSL.Error) and exc.args and isinstance(exc.args[0], list):
        return "; ".join(str(part[2]) for part in exc.args[0] if len(part) > 2) or repr(exc)
    return str(exc)


def peer_tls(transport: Any, server_tls: ServerTls | None) -> PeerTls | None:
    """The connection's TLS, once its handshake is done; None on plaintext."""
    if server_tls is None or not ISSLTransport.providedBy(transport):
        return None
    try:
        handle = transport.getHandle()
        version = handle.get_protocol_version_name() or ""
        cipher = handle.get_cipher_name() or ""
        cert = transport.getPeerCertificate()
    except (AttributeError, SSL.Error):
        return None
    name = ""
    if cert is not None:
        name = cert.get_subject().commonName or ""
    return PeerTls(version, cipher, name, cert is not None and server_tls.verifies_clients)

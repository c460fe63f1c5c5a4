"""NSQ's two error kinds: one keeps the connection, the other closes it.

nsqd (``internal/protocol/errors.go``) answers a bad command with an error frame
whose text is ``"<CODE> <description>"``. A ``ClientError`` (only ``E_FIN_FAILED``,
``E_REQ_FAILED`` and ``E_TOUCH_FAILED`` in nsqd) leaves the connection open; a
``FatalClientError`` is followed by closing it. The adapter decides by ``fatal``
alone. dmq adds non-fatal publish failures for reliable topics (see docs/nsq.md).
These are the NSQ adapter's replies; the broker's errors (``core.errors``) are mapped
to them by ``protocols.nsq_v2``.
"""

from __future__ import annotations

from dmq_server.core.errors import DmqError

__all__ = ["NsqError", "ClientError", "FatalClientError", "CloseSilently"]


class NsqError(DmqError):
    """An error the client is told about: ``code`` and ``description`` go on the wire;
    ``str()`` is the whole frame text, as nsqd logs it."""

    fatal = True

    def __init__(self, code: str, description: str):
        super().__init__(description, code=code)
        self.args = (f"{code} {description}",)

    @property
    def text(self) -> bytes:
        """The error frame's data: ``b"<CODE> <description>"``."""
        return f"{self.code} {self.description}".encode("utf-8", "replace")


class ClientError(NsqError):
    """Non-fatal: the error frame is sent and the connection goes on."""

    fatal = False


class FatalClientError(NsqError):
    """Fatal: the error frame is sent, then the connection is closed."""

    fatal = True


class CloseSilently(Exception):
    """The peer broke framing in a way nsqd answers by closing without a frame
    (a command line longer than nsqd's read buffer)."""

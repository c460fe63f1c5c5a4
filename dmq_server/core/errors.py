"""The errors a client is told about: one family, ``DmqError(code, description, fatal)``.

Everything below the protocol adapters (broker, stores, database seam) fails with a
``DmqError`` subclass; each adapter turns it into its own reply with one table keyed
by the subclass (``protocols.dmq``: a reply command; ``protocols.nsq_v2``: an error
frame; ``http.nsqd`` and ``http.admin_api``: a status code; the admin console: an ``ERR``
line; the ``dmq`` CLI: an exit status). The subclass says what the client can do about
it, so adapters never compare class names or parse texts:

* ``Refused``: the request itself is wrong (a bad field, an unknown topic, over a
  rate limit, a missing admin token). Nothing was stored or changed; sending it
  again unchanged fails again.
* ``Unavailable``: the server could not take it now (PostgreSQL failing, shutting
  down, a fast topic closing). Whether it was stored may be unknown; a producer sends
  it again, here or elsewhere, and duplicate suppression sorts out the rest.

``fatal`` is for adapters whose protocol closes the connection after some errors
(NSQ closes after a failed fast publish, as nsqd does); ``code`` is the ``E_…`` word
clients match on, ``description`` the sentence after it (``status`` joins the two).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar, overload

_Reply = TypeVar("_Reply")

__all__ = [
    "DmqError",
    "Refused",
    "Invalid",
    "NoTopic",
    "NoChannel",
    "RateLimited",
    "NotFound",
    "Unauthorized",
    "Forbidden",
    "AuthFirst",
    "AuthFailed",
    "NotPermitted",
    "AuthDisabled",
    "TlsRequired",
    "Unavailable",
    "ShuttingDown",
    "Exiting",
    "QueueFailed",
    "OverBudget",
    "reply_for",
]


class DmqError(Exception):
    """An error with a code clients match on; ``str()`` is the description alone."""

    code = "E_INTERNAL"
    fatal = False

    def __init__(self, description: str, *, code: str | None = None, fatal: bool | None = None):
        super().__init__(description)
        self.description = description
        if code is not None:
            self.code = code
        if fatal is not None:
            self.fatal = fatal

    @property
    def status(self) -> str:
        """``"<CODE> <description>"``: the text of a reply's status or error frame."""
        return f"{self.code} {self.description}"


class Refused(DmqError):
    """The request is wrong as sent; it was not stored."""

    code = "E_INVALID"


class Invalid(Refused):
    """A field breaks a rule (``code`` may be narrower: E_BAD_TOPIC, E_BAD_BODY)."""


class NoTopic(Refused):
    code = "E_NO_TOPIC"


class NoChannel(Refused):
    code = "E_NO_CHANNEL"


class RateLimited(Refused):
    code = "E_RATE_LIMITED"


class NotFound(Refused):
    """What the request names does not exist (a dead letter, an admin endpoint)."""

    code = "E_NOT_FOUND"


class Unauthorized(Refused):
    """No token, or a wrong one, where one is needed."""

    code = "E_AUTH"


class Forbidden(Refused):
    """Not allowed here whatever the token (an admin surface on a non-loopback
    address without --admin-token refuses every command)."""

    code = "E_AUTH"


class AuthFirst(Unauthorized):
    """Authentication is on and the client has not authenticated (nsqd's code)."""

    code = "E_AUTH_FIRST"


class AuthFailed(Unauthorized):
    """The secret was refused, or the authorizer could not be asked (the reason is
    logged, never told: nsqd's rule for untrusted clients)."""

    code = "E_AUTH_FAILED"


class NotPermitted(Forbidden):
    """Authenticated, but not allowed this on that topic or channel (nsqd's code)."""

    code = "E_UNAUTHORIZED"


class AuthDisabled(Refused):
    """The client authenticated on a server without authentication (nsqd's code)."""

    code = "E_AUTH_DISABLED"


class TlsRequired(Forbidden):
    """Plaintext where the server requires TLS."""

    code = "E_TLS_REQUIRED"


class Unavailable(DmqError):
    """The server could not take the request now; try again, or another node."""

    code = "E_UNAVAILABLE"


class ShuttingDown(Unavailable):
    """The server is stopping and takes no new sends."""

    code = "E_SHUTTING_DOWN"

    def __init__(self, description: str = "server is restarting, send elsewhere"):
        super().__init__(description)


class Exiting(Unavailable):
    """A fast topic or channel is being deleted or closed (nsqd's ``exiting``)."""

    code = "E_EXITING"
    fatal = True

    def __init__(self, description: str = "exiting"):
        super().__init__(description)


class QueueFailed(Unavailable):
    """A fast topic's disk queue failed to take a message (nsqd's E_PUB_FAILED)."""

    code = "E_QUEUE"
    fatal = True


class OverBudget(Unavailable):
    """What the request would have the server hold has nowhere to wait but memory, and
    the server's ``--max-client-memory`` has no room for it now (fast topics' deferred
    messages); nothing was taken."""

    code = "E_MEMORY"

    def __init__(self, description: str = "deferred messages fill the server's memory budget "
                 "(--max-client-memory): publish again later, or without a delay"):
        super().__init__(description)


@overload
def reply_for(error: BaseException, table: Mapping[type[DmqError], _Reply]) -> _Reply | None: ...
@overload
def reply_for(error: BaseException, table: Mapping[type[DmqError], _Reply], default: _Reply) -> _Reply: ...
def reply_for(error: BaseException, table: Mapping[type[DmqError], _Reply],
              default: _Reply | None = None) -> _Reply | None:
    """The entry of ``table`` for ``error``'s class or its nearest base in it: how an
    adapter writes its table once (``{NoTopic: …, Refused: …, Unavailable: …}``)."""
    for cls in type(error).__mro__:
        found = table.get(cls) if issubclass(cls, DmqError) else None
        if found is not None:
            return found
    return default

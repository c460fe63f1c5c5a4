"""What the server asks of a clock: the time, and a call later that can be cancelled.

The reactor answers it in production and ``twisted.internet.task.Clock`` in tests, so
every timer in the server runs on an injected clock a test can advance. Stated here
as a ``typing.Protocol`` (standard library only, like the rest of ``core/``) rather
than as Twisted's ``IReactorTime``, so the type checker holds both to the two calls
the server makes; both satisfy it without naming it.
"""

from __future__ import annotations

from typing import Callable, Protocol


class Timer(Protocol):
    """A pending call (Twisted's ``IDelayedCall``): cancel it while it is active."""

    def active(self) -> bool: ...

    def cancel(self) -> None: ...


class Clock(Protocol):
    """The time in seconds, and ``callable(*args, **kw)`` after ``delay`` seconds."""

    def seconds(self) -> float: ...

    # the parameter names are Twisted's: a protocol's names must match its implementers'
    def callLater(self, delay: float, callable: Callable[..., object], *args: object, **kw: object) -> Timer: ...

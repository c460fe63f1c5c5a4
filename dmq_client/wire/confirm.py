"""The status of ``SEND_CONSUMED_ACK``: what became of a message every channel was to consume.

Server and clients share this text format (docs/protocol.md §4.14), so it lives with the
codec: the server writes it with ``consumed_status``, the clients read it with
``parse_consumed``. Channel names cannot hold a space, a comma or ``=`` (``valid_name``),
so the lists need no quoting:

    CONSUMED acked=billing,audit
    E_DEAD_LETTERED acked=billing dead=audit
    E_DEADLINE acked=billing waiting=audit
    E_DEADLINE PostgreSQL did not answer before the deadline
    E_INVALID confirmation deadline 90000000 ms is above 86400000

The first word is the code; for the three outcomes the other words are ``acked=``,
``dead=`` and ``waiting=`` lists (an empty list is left out) and maybe words of text
(the description); for a refusal (``E_INVALID``,
``E_UNSUPPORTED``, ``E_LIMIT``) the rest is a description for humans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["CONSUMED", "DEAD_LETTERED", "DEADLINE", "OUTCOMES", "ConsumedReport", "consumed_status", "parse_consumed"]

CONSUMED = "CONSUMED"  # every channel acknowledged the message
DEAD_LETTERED = "E_DEAD_LETTERED"  # every channel is done with it, some by a dead letter
DEADLINE = "E_DEADLINE"  # the deadline came with some channel not done
OUTCOMES = frozenset({CONSUMED, DEAD_LETTERED, DEADLINE})


@dataclass(frozen=True, slots=True)
class ConsumedReport:
    """A ``SEND_CONSUMED_ACK`` status read: the code, the channels by what they did with
    the message, and a refusal's description."""

    code: str
    acked: tuple[str, ...] = ()
    dead: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    description: str = ""


def consumed_status(code: str, acked: Iterable[str] = (), dead: Iterable[str] = (),
                    waiting: Iterable[str] = ()) -> str:
    """The status for one of the three outcomes; each list sorted, empty ones left out."""
    words = [code]
    for key, names in (("acked", acked), ("dead", dead), ("waiting", waiting)):
        ordered = sorted(names)
        if ordered:
            words.append(f"{key}={','.join(ordered)}")
    return " ".join(words)


def parse_consumed(status: str) -> ConsumedReport:
    """``consumed_status``'s inverse; a refusal's text after its code is the description,
    as are an outcome's words that are not lists. Lists it does not know are ignored (a
    later server may add some)."""
    code, _, rest = status.partition(" ")
    if code not in OUTCOMES:
        return ConsumedReport(code, description=rest)
    lists: dict[str, tuple[str, ...]] = {}
    text = []
    for word in rest.split():
        key, sep, names = word.partition("=")
        if sep:
            lists[key] = tuple(name for name in names.split(",") if name)
        else:
            text.append(word)
    return ConsumedReport(code, lists.get("acked", ()), lists.get("dead", ()), lists.get("waiting", ()),
                          " ".join(text))

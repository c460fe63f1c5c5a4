"""Who a client is and what it may do, IO-free: the answer of an auth server, and the file
that stands in for one.

The contract is nsqd's (``internal/auth``), so an auth server written for nsqd serves dmq
unchanged. A client presents a secret (NSQ ``AUTH``, dmq ``UP_AUTH``, HTTP ``Authorization:
Bearer``); the server asks ``GET /auth?remote_ip=&tls=&secret=&common_name=`` and gets::

    {"ttl": 3600, "identity": "billing", "identity_url": "https://...",
     "authorizations": [{"topic": "^orders$", "channels": [".*"],
                         "permissions": ["publish", "subscribe"]}]}

An authorization allows its permissions on every topic its ``topic`` regex finds and, for
``subscribe``, every channel one of its ``channels`` regexes finds. The regexes are
searched, not anchored, as Go's ``MatchString`` does: ``orders`` also finds ``old-orders``
(write ``^orders$``). A publish is checked against the channel ``""``, as nsqd does, so a
publishing authorization needs a channel regex that finds the empty string (``.*``).
dmq adds the permission ``admin``: topic and channel administration over HTTP and the
admin API (an operation on no particular topic is checked against topic ``""``).

An answer is refused whole, as nsqd refuses it, when its ``ttl`` is not above 0, a
permission is unknown or a regex does not compile. The answer holds for ``ttl`` seconds;
a connection whose answer expired asks again before its next publish or subscribe.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Mapping

__all__ = [
    "PUBLISH",
    "SUBSCRIBE",
    "ADMIN",
    "PERMISSIONS",
    "AnswerError",
    "Grant",
    "AuthState",
    "parse_answer",
    "AuthFile",
    "parse_auth_file",
]

PUBLISH, SUBSCRIBE, ADMIN = "publish", "subscribe", "admin"
PERMISSIONS = frozenset({PUBLISH, SUBSCRIBE, ADMIN})
#: decisions remembered per answer (topic and channel names repeat; the bound keeps a
#: client naming endless topics from growing it)
DECISION_CACHE = 1024
#: a file entry's ttl when it gives none: the file is re-read on SIGHUP, and connections
#: see the new entry once this runs out
FILE_DEFAULT_TTL = 3600


class AnswerError(ValueError):
    """The authorizer's answer cannot be used (the client hears E_AUTH_FAILED)."""


@dataclass(frozen=True)
class Grant:
    """One authorization: permissions on the topics and channels its regexes find."""

    topic: re.Pattern[str]
    channels: tuple[re.Pattern[str], ...]
    permissions: frozenset[str]

    def allows(self, permission: str, topic: str, channel: str) -> bool:
        if permission not in self.permissions or self.topic.search(topic) is None:
            return False
        return any(c.search(channel) is not None for c in self.channels)


class AuthState:
    """One answer: who the client is, until when, and what it may do."""

    def __init__(self, identity: str, identity_url: str, ttl: int, expires: float, grants: tuple[Grant, ...]):
        self.identity = identity
        self.identity_url = identity_url
        self.ttl = ttl
        self.expires = expires
        self.grants = grants
        self._decisions: dict[tuple[str, str, str], bool] = {}

    def expired(self, now: float) -> bool:
        return now >= self.expires

    def allows(self, permission: str, topic: str, channel: str = "") -> bool:
        key = (permission, topic, channel)
        decided = self._decisions.get(key)
        if decided is None:
            decided = any(g.allows(permission, topic, channel) for g in self.grants)
            if len(self._decisions) >= DECISION_CACHE:
                self._decisions.clear()
            self._decisions[key] = decided
        return decided

    def reply(self) -> bytes:
        """What an authenticated client is told (nsqd's AUTH response)."""
        body = {"identity": self.identity, "identity_url": self.identity_url, "permission_count": len(self.grants)}
        return json.dumps(body, separators=(",", ":")).encode()

    def __repr__(self) -> str:
        return f"AuthState({self.identity!r}, {len(self.grants)} authorizations, ttl {self.ttl})"


def _compile(pattern: object, what: str) -> re.Pattern[str]:
    if not isinstance(pattern, str):
        raise AnswerError(f"{what} must be a string regex, not {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise AnswerError(f"unable to compile {what} {pattern!r}: {exc}") from None


def parse_answer(data: bytes | str | Mapping[str, object], now: float, default_ttl: int | None = None) -> AuthState:
    """An ``AuthState`` from an auth server's JSON answer (or its decoded object), valid
    from ``now`` for its ttl; ``AnswerError`` says why an answer cannot be used."""
    if isinstance(data, (bytes, str)):
        try:
            data = json.loads(data)
        except ValueError as exc:
            raise AnswerError(f"answer is not JSON: {exc}") from None
    if not isinstance(data, Mapping):
        raise AnswerError("answer is not a JSON object")
    ttl = data.get("ttl", default_ttl)
    if not isinstance(ttl, int) or isinstance(ttl, bool) or ttl <= 0:
        raise AnswerError(f"invalid TTL {ttl!r} (must be >0)")
    identity, url = data.get("identity", ""), data.get("identity_url", "")
    if not isinstance(identity, str) or not isinstance(url, str):
        raise AnswerError("identity and identity_url must be strings")
    raw = data.get("authorizations") or []
    if not isinstance(raw, list):
        raise AnswerError("authorizations must be a list")
    grants = []
    for item in raw:
        if not isinstance(item, Mapping):
            raise AnswerError(f"an authorization must be an object, not {item!r}")
        permissions = item.get("permissions") or []
        if not isinstance(permissions, list):
            raise AnswerError("permissions must be a list")
        for p in permissions:
            if p not in PERMISSIONS:
                raise AnswerError(f"unknown permission {p!r}")
        channels = item.get("channels") or []
        if not isinstance(channels, list):
            raise AnswerError("channels must be a list")
        grants.append(
            Grant(
                _compile(item.get("topic", ""), "topic"),
                tuple(_compile(c, "channel") for c in channels),
                frozenset(permissions),
            )
        )
    return AuthState(identity, url, ttl, now + ttl, tuple(grants))


class AuthFile:
    """``--auth-file``: an auth server's answers kept in a file, keyed by secret (and by
    the common name of a verified client certificate, for clients that present no secret)."""

    def __init__(self, secrets: dict[str, dict], common_names: dict[str, dict]):
        self.secrets = secrets
        self.common_names = common_names

    def answer(self, secret: str, common_name: str, now: float) -> AuthState | None:
        """The state for a secret, or with none for the certificate's name; None: unknown."""
        entry = self.secrets.get(secret) if secret else self.common_names.get(common_name) if common_name else None
        if entry is None:
            return None
        return parse_answer(entry, now, FILE_DEFAULT_TTL)


def parse_auth_file(text: str, source: str = "<auth file>") -> AuthFile:
    """The file's entries, each checked as an answer now (so a bad file fails at start or
    on reload, not at a client's first AUTH)::

        {"secrets": {"SECRET": ANSWER, ...}, "common_names": {"CN": ANSWER, ...}}
    """
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise AnswerError(f"{source}: not JSON: {exc}") from None
    if not isinstance(data, dict) or not set(data) <= {"secrets", "common_names"}:
        raise AnswerError(f"{source}: expected an object with \"secrets\" and optionally \"common_names\"")
    maps: list[dict[str, dict]] = []
    for key in ("secrets", "common_names"):
        entries = data.get(key) or {}
        if not isinstance(entries, dict):
            raise AnswerError(f"{source}: {key} must be an object")
        for name, entry in entries.items():
            if not name:
                raise AnswerError(f"{source}: {key} has an empty key")
            try:
                parse_answer(entry, 0.0, FILE_DEFAULT_TTL)
            except AnswerError as exc:
                label = _redact(name) if key == "secrets" else repr(name)
                raise AnswerError(f"{source}: {key}[{label}]: {exc}") from None
        maps.append(entries)
    return AuthFile(maps[0], maps[1])


def _redact(secret: str) -> str:
    """A secret as it may appear in a log or an error: its first characters only."""
    return repr(secret[:3] + "…") if len(secret) > 3 else "'…'"

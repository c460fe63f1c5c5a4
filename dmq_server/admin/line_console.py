"""The line-based admin console (``--admin-address``, default 127.0.0.1:4152).

Like DMQ's telnet server: connect with ``telnet HOST 4152`` or ``nc HOST 4152``
and type commands. Every command is one line; every answer ends with exactly one
status line, ``OK <summary>`` or ``ERR <CODE> <message>``, preceded by zero or
more data lines (one JSON object each) and, for long operations, ``PROGRESS``
lines. Lines starting with ``#`` are informational. A bad command gets an
``ERR`` and the session carries on; commands are answered in the order sent.

::

    help                              this list
    auth TOKEN                        authenticate (needed with --admin-token, or with
                                      authentication on: a secret with the admin permission)
    stats                             live and stored statistics
    topics                            topics, their settings and channels
    clients                           connected clients (dmq and NSQ)
    delay                             delay fragments, workers, pending counts
    dlq list [FILTER...] [limit=N] [after=ID]
    dlq show ID
    dlq replay ID... | FILTER... | all
    dlq delete ID... | FILTER... | all
    quit

FILTER is ``key=value`` with key topic, channel, reason, since, until, ids,
message_ids or replayed; times are Unix ms, ISO 8601, or a duration ago (15m).

Bounds: a line longer than ``MAX_LENGTH`` (16 KiB) is answered ``ERR E_LINE_TOO_LONG``
in its turn and the lines after it are still run. At most ``MAX_QUEUED`` lines wait
for their turn: then the console stops reading the connection, and it runs no
further command while its answers are not being read (the transport's write buffer
is full). A session without a command for ``--admin-idle-timeout`` is closed, and so
is one whose line, once started, is not finished within ``--read-timeout`` (a client
trickling bytes, as the TCP ports close one: ``protocols.flow``). When
the client half-closes (``nc -N``, ``printf ... | nc``), every command already sent
is answered before the connection closes.

Why one long module: the line protocol (framing, queueing, back-pressure, half-close)
and one short method per command; the operations themselves are in operations.py.
"""

from __future__ import annotations

import hmac
import json
import shlex
from collections import deque
from typing import Callable

from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.interfaces import IHalfCloseableProtocol, IPushProducer
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from dmq_server.admin.operations import AdminOps, DeadLetterFilter, check_token, parse_limit
from dmq_server.core.auth import ADMIN, AuthState
from dmq_server.core.clock import Clock, Timer
from dmq_server.core.errors import DmqError, Invalid, NotPermitted, Refused, Unauthorized
from dmq_server.core.transport import Transport
from dmq_server.security.session import CredentialCache

__all__ = ["AdminConsole", "AdminConsoleFactory", "parse_line", "HELP"]

log = Logger()

HELP = [
    "help                                   this list",
    "auth TOKEN                             authenticate (--admin-token, or a secret with the admin permission)",
    "stats                                  live and stored statistics",
    "topics                                 topics, settings and channels",
    "clients                                connected clients",
    "delay                                  delay fragments, workers and pending counts",
    "dlq list [FILTER...] [limit=N] [after=ID]",
    "dlq show ID",
    "dlq replay ID... | FILTER... | all      put dead letters back into the reliable flow",
    "dlq delete ID... | FILTER... | all      remove dead letters",
    "channel pause|unpause|empty topic=T channel=C   a reliable channel's pushes; empty drops its copies",
    "quit                                   close the session",
    "FILTER: topic=, channel=, reason=, since=, until=, ids=1,2, message_ids=, replayed=true|false",
    "times: Unix ms, ISO 8601 (2024-05-01T12:00:00Z) or a duration ago (15m, 2h, 7d)",
]


class Parsed:
    """A console line: words (the verb path), ``key=value`` options, bare ids, ``all``."""

    def __init__(self, words: list[str], options: dict[str, str], ids: list[int], everything: bool):
        self.words = words
        self.options = options
        self.ids = ids
        self.everything = everything


def parse_line(line: str) -> Parsed:
    """Split one console line; raises ``Invalid`` on quoting or option errors."""
    try:
        tokens = shlex.split(line, comments=False, posix=True)
    except ValueError as exc:
        raise Invalid(f"cannot parse the line: {exc}") from None
    words: list[str] = []
    options: dict[str, str] = {}
    ids: list[int] = []
    everything = False
    for token in tokens:
        if "=" in token:
            key, _, value = token.partition("=")
            if not key:
                raise Invalid(f"option {token!r} has no name before '='")
            if key in options:
                raise Invalid(f"option {key!r} given twice")
            options[key] = value
        elif token.isdigit():
            ids.append(int(token))
        elif token == "all" and words[:1] == ["dlq"]:
            everything = True
        else:
            if options or ids:
                raise Invalid(f"unexpected word {token!r} after the arguments")
            words.append(token.lower())
    return Parsed(words, options, ids, everything)


#: a queued line too long to run: answered with E_LINE_TOO_LONG in its turn
_TOO_LONG = None
#: seconds a closed session may take to send its last answers before it is aborted
ABORT_AFTER = 30.0


@implementer(IHalfCloseableProtocol, IPushProducer)
class AdminConsole(Protocol):
    # ITransport is a zope interface, nominal to mypy and read without self; Twisted's
    # transports and StringTransport have this shape (dmq_server.core.transport)
    transport: Transport  # type: ignore[assignment]
    delimiter = b"\n"
    MAX_LENGTH = 16384
    MAX_QUEUED = 64
    OUTPUT_HIGH_WATER = 262144

    def __init__(
        self, ops: AdminOps, listen_host: str, token: str, clock: Clock, idle_timeout: float = 900.0,
        credentials: CredentialCache | None = None, read_timeout: float = 0.0,
    ):
        self.ops = ops
        self.listen_host = listen_host
        self.token = token
        self.read_timeout = read_timeout
        self._line_timer: Timer | None = None  # runs from a line's first byte to its end
        # with authentication on (security.session.CredentialCache): `auth SECRET` whose
        # answer has the admin permission opens the session too, and nothing is open without
        self.credentials = credentials
        self.authenticated = False
        self.peer = "?"
        self._queue: deque[bytes | None] = deque()  # None: a line too long (_TOO_LONG)
        self._busy = False
        self._discarding = False
        self._buffer = bytearray()
        self._input_closed = False  # the client half-closed: answer what it sent, then close
        self._output_paused = False  # the client is not reading our answers
        self._reading_paused = False
        self._gone = False
        self.clock = clock
        self.idle_timeout = idle_timeout
        self._idle_timer: Timer | None = None
        self._abort_timer: Timer | None = None
        self._commands: dict[tuple[str, ...], Callable[[Parsed], Deferred | None]] = {
            ("help",): self.cmd_help,
            ("stats",): self.cmd_stats,
            ("topics",): self.cmd_topics,
            ("clients",): self.cmd_clients,
            ("delay",): self.cmd_delay,
            ("delay", "stats"): self.cmd_delay,
            ("dlq", "list"): self.cmd_dlq_list,
            ("dlq", "show"): self.cmd_dlq_show,
            ("dlq", "replay"): self.cmd_dlq_replay,
            ("dlq", "delete"): self.cmd_dlq_delete,
            ("channel", "pause"): self.cmd_channel,
            ("channel", "unpause"): self.cmd_channel,
            ("channel", "empty"): self.cmd_channel,
            ("quit",): self.cmd_quit,
            ("exit",): self.cmd_quit,
        }

    # -- connection --------------------------------------------------------------
    def connectionMade(self) -> None:
        self.transport.bufferSize = self.OUTPUT_HIGH_WATER
        self.transport.registerProducer(self, True)
        self._arm_idle()
        peer = self.transport.getPeer()
        self.peer = f"{getattr(peer, 'host', '?')}:{getattr(peer, 'port', '?')}"
        try:
            self._open_without_token()
            self.authenticated = True
            note = "type help for the commands"
        except Refused:
            note = "authenticate with: auth TOKEN (help lists the commands)"
        self.info(f"dmq admin console, node {self.ops.node_id}; {note}")

    def send(self, line: str) -> None:
        if self._gone:
            return
        self.transport.write(line.replace("\r", " ").replace("\n", " ").encode("utf-8") + self.delimiter)

    def info(self, text: str) -> None:
        self.send(f"# {text}")

    def ok(self, summary: str = "") -> None:
        self.send(f"OK {summary}".rstrip())

    def error(self, code: str, message: str) -> None:
        self.send(f"ERR {code} {message}")

    def data(self, obj: object) -> None:
        self.send(json.dumps(obj, sort_keys=False, default=str))

    def _show(self, obj: object, summary: str) -> None:
        self.data(obj)
        self.ok(summary)

    # -- input -------------------------------------------------------------------
    def dataReceived(self, data: bytes) -> None:
        """Split lines; a line over MAX_LENGTH is queued as an error and the bytes up to
        its end are dropped, so the lines pipelined after it still run in order."""
        buf = self._buffer
        buf += data
        start = 0
        while True:
            end = buf.find(self.delimiter, start)
            if end < 0:
                break
            line = bytes(buf[start:end])
            start = end + 1
            if self._discarding:
                self._discarding = False  # the end of a line already refused
            elif len(line) > self.MAX_LENGTH:
                self._queue.append(_TOO_LONG)
            else:
                self._queue.append(line)
        del buf[:start]
        if len(buf) > self.MAX_LENGTH and not self._discarding:
            self._queue.append(_TOO_LONG)  # refused now; the rest of it is dropped on arrival
            self._discarding = True
        if self._discarding:
            del buf[:]
        self._time_line(bool(buf) or self._discarding)
        if len(self._queue) >= self.MAX_QUEUED and not self._reading_paused:
            self._reading_paused = True
            self.transport.pauseProducing()
        self._next()

    def _next(self) -> None:
        while not self._busy and self._queue and not self._output_paused and not self._gone:
            line = self._queue.popleft()
            self._busy = True
            self._arm_idle()
            d = maybeDeferred(self._handle, line)
            d.addErrback(self._failed)
            d.addBoth(self._done)
        if self._reading_paused and len(self._queue) < self.MAX_QUEUED // 2 and not self._gone:
            self._reading_paused = False
            self.transport.resumeProducing()
        if self._input_closed and not self._busy and not self._queue:
            self._close()

    def _done(self, _: object) -> None:
        self._busy = False
        self._arm_idle()
        if not self._gone and not getattr(self.transport, "disconnecting", False):
            self._next()

    # -- the connection's ends -----------------------------------------------------
    def readConnectionLost(self) -> None:
        """The client sent everything (half-close): answer it all, then close."""
        self._input_closed = True
        self._next()

    def writeConnectionLost(self) -> None:
        self._close()

    def _close(self) -> None:
        transport = self.transport
        if not self._gone and transport is not None and not getattr(transport, "disconnecting", False):
            transport.unregisterProducer()  # a registered producer would keep it open
            transport.loseConnection()
            # Twisted closes once every answer is sent: a client that reads nothing would
            # keep the connection for ever
            self._abort_timer = self.clock.callLater(ABORT_AFTER, self._abort)

    def _abort(self) -> None:
        self._abort_timer = None
        if not self._gone:
            abort = getattr(self.transport, "abortConnection", None)
            if abort is not None:
                abort()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._gone = True
        self._queue.clear()
        self._cancel_idle()
        self._time_line(False)
        if self._abort_timer is not None and self._abort_timer.active():
            self._abort_timer.cancel()
        self._abort_timer = None

    # IPushProducer: the transport's write buffer (the client reads our answers or not)
    def pauseProducing(self) -> None:
        self._output_paused = True

    def resumeProducing(self) -> None:
        if getattr(self.transport, "disconnecting", False):
            self.transport.unregisterProducer()
            return
        self._output_paused = False
        self._next()

    def stopProducing(self) -> None:
        self._gone = True

    # -- the idle timeout ------------------------------------------------------------
    def _arm_idle(self) -> None:
        """Restarted at each command's start and end; never fires while one runs."""
        self._cancel_idle()
        if self.idle_timeout > 0 and not self._busy and not self._gone:
            self._idle_timer = self.clock.callLater(self.idle_timeout, self._idle)

    def _cancel_idle(self) -> None:
        if self._idle_timer is not None and self._idle_timer.active():
            self._idle_timer.cancel()
        self._idle_timer = None

    def _idle(self) -> None:
        self._idle_timer = None
        if self._busy or self._gone:
            return
        log.info("admin console {peer}: idle for {t}s, closing", peer=self.peer, t=self.idle_timeout)
        self.info(f"no command for {self.idle_timeout:g}s; closing the session")
        self._close()

    # -- the read timeout: a line must be finished once started ----------------------
    def _time_line(self, partial: bool) -> None:
        if partial and self._line_timer is None and self.read_timeout > 0 and not self._gone:
            self._line_timer = self.clock.callLater(self.read_timeout, self._line_late)
        elif not partial and self._line_timer is not None:
            if self._line_timer.active():
                self._line_timer.cancel()
            self._line_timer = None

    def _line_late(self) -> None:
        self._line_timer = None
        if self._gone:
            return
        log.info("admin console {peer}: a line not finished within {t}s, closing", peer=self.peer, t=self.read_timeout)
        self._buffer.clear()
        self._queue.clear()
        self.error("E_TIMEOUT", f"line not finished within {self.read_timeout:g}s; closing the session")
        self._close()

    def _failed(self, failure: Failure) -> None:
        error = failure.value
        if isinstance(error, DmqError):  # refused, or PostgreSQL failing (E_STORAGE)
            self.error(error.code, error.description)
        else:
            log.failure("admin console command failed", failure)
            self.error("E_INTERNAL", repr(error))

    def _handle(self, raw: bytes | None) -> Deferred | None:
        if raw is _TOO_LONG:
            raise Invalid(f"a command line may be at most {self.MAX_LENGTH} bytes; line dropped", code="E_LINE_TOO_LONG")
        try:
            line = raw.rstrip(b"\r").decode("utf-8")
        except UnicodeDecodeError:
            raise Invalid("commands must be UTF-8 text", code="E_BAD_ENCODING") from None
        if not line.strip() or line.lstrip().startswith("#"):
            return None  # blank lines and comments get no answer
        verb, _, rest = line.strip().partition(" ")
        if verb.lower() == "auth":  # the token is taken verbatim (case, '=', quotes)
            return self.cmd_auth(rest.strip())
        parsed = parse_line(line)
        handler = None
        for size in (2, 1):
            handler = self._commands.get(tuple(parsed.words[:size]))
            if handler is not None:
                extra = parsed.words[size:]
                break
        if handler is None:
            shown = " ".join(parsed.words) or line.strip()
            raise Invalid(f"unknown command {shown!r}; type help for the commands", code="E_UNKNOWN_COMMAND")
        if extra:
            raise Invalid(f"unexpected word {extra[0]!r}; type help for the usage")
        if not self.authenticated and handler not in (self.cmd_help, self.cmd_quit):
            try:
                self._open_without_token()
            except Refused as exc:
                raise type(exc)(f"{exc.description}; not authenticated") from None
        return handler(parsed)

    # -- commands ----------------------------------------------------------------
    def cmd_help(self, parsed: Parsed) -> None:
        for line in HELP:
            self.info(line)
        self.ok(f"{len(HELP)} lines")

    def _open_without_token(self) -> None:
        """Raise unless a session may run commands without ``auth``."""
        if self.credentials is not None:
            raise Unauthorized("authentication is on: auth TOKEN (--admin-token) or auth SECRET (admin permission)")
        check_token(self.listen_host, self.token, None)

    def cmd_auth(self, token: str) -> Deferred | None:
        if not token:
            raise Invalid("usage: auth TOKEN")
        if self.credentials is None or (self.token and hmac.compare_digest(token.encode(), self.token.encode())):
            check_token(self.listen_host, self.token, token)
            self.authenticated = True
            self.ok("authenticated")
            return None
        host = self.peer.rsplit(":", 1)[0]
        found = self.credentials.lookup(token, host, None)
        answer: Deferred = found if isinstance(found, Deferred) else succeed(found)
        return answer.addCallback(self._authorized)

    def _authorized(self, state: AuthState) -> None:
        if not state.allows(ADMIN, "", ""):
            log.warn("admin console {peer}: {identity} has no admin permission", peer=self.peer, identity=state.identity)
            raise NotPermitted(f"{state.identity or 'this secret'} has no admin permission")
        self.authenticated = True
        log.info("admin console {peer}: authenticated as {identity}", peer=self.peer, identity=state.identity)
        self.ok(f"authenticated as {state.identity}")

    def cmd_stats(self, parsed: Parsed) -> Deferred:
        return self.ops.stats().addCallback(self._show, "stats")

    def cmd_topics(self, parsed: Parsed) -> None:
        topics = self.ops.topics()
        for topic in topics:
            self.data(topic)
        self.ok(f"{len(topics)} topics")

    def cmd_clients(self, parsed: Parsed) -> None:
        clients = self.ops.clients()
        for client in clients:
            self.data(client)
        self.ok(f"{len(clients)} clients")

    def cmd_delay(self, parsed: Parsed) -> Deferred:
        return self.ops.delay_stats().addCallback(self._show, "delay")

    def _filter(self, parsed: Parsed, extra: tuple[str, ...] = ()) -> tuple[DeadLetterFilter, dict]:
        options = dict(parsed.options)
        rest = {k: options.pop(k) for k in extra if k in options}
        if parsed.ids:
            if "ids" in options:
                raise Invalid("give ids either as words or as ids=, not both")
            options["ids"] = ",".join(str(i) for i in parsed.ids)
        return DeadLetterFilter.parse(options), rest

    def cmd_dlq_list(self, parsed: Parsed) -> Deferred:
        flt, rest = self._filter(parsed, ("limit", "after"))
        limit = parse_limit(rest.get("limit"))
        after = parse_limit(rest.get("after"), 0, "after") if rest.get("after") else 0

        def show(rows: list[dict]) -> None:
            for row in rows:
                self.data(row)
            more = f"; more after={rows[-1]['id']}" if len(rows) == limit else ""
            self.ok(f"{len(rows)} dead letters{more}")

        return self.ops.dlq_list(flt, limit, after).addCallback(show)

    def cmd_dlq_show(self, parsed: Parsed) -> Deferred:
        if len(parsed.ids) != 1 or parsed.options or parsed.everything:
            raise Invalid("usage: dlq show ID")
        return self.ops.dlq_show(parsed.ids[0]).addCallback(self._show, "1 dead letter")

    def _progress(self, verb: str) -> Callable[[int, int], None]:
        def progress(done: int, total: int) -> None:
            self.send(f"PROGRESS {verb} {done}/{total}")

        return progress

    def cmd_dlq_replay(self, parsed: Parsed) -> Deferred:
        flt, _ = self._filter(parsed)
        d = self.ops.dlq_replay(flt, parsed.everything, "console", self.peer, self._progress("replayed"))
        return d.addCallback(lambda n: self.ok(f"replayed {n}"))

    def cmd_dlq_delete(self, parsed: Parsed) -> Deferred:
        flt, _ = self._filter(parsed)
        d = self.ops.dlq_delete(flt, parsed.everything, "console", self.peer, self._progress("deleted"))
        return d.addCallback(lambda n: self.ok(f"deleted {n}"))

    def cmd_channel(self, parsed: Parsed) -> Deferred:
        topic, channel = parsed.options.get("topic"), parsed.options.get("channel")
        if not topic or not channel or set(parsed.options) != {"topic", "channel"} or parsed.ids:
            raise Invalid(f"usage: channel {parsed.words[1]} topic=T channel=C")
        d = self.ops.channel_action(parsed.words[1], topic, channel, "console", self.peer)
        return d.addCallback(self.ok)

    def cmd_quit(self, parsed: Parsed) -> None:
        self.ok("bye")
        self._queue.clear()
        self._close()


class AdminConsoleFactory(Factory):
    noisy = False

    def __init__(
        self, ops: AdminOps, listen_host: str, token: str, clock: Clock, idle_timeout: float = 900.0,
        credentials: CredentialCache | None = None, read_timeout: float = 0.0,
    ):
        self.ops = ops
        self.listen_host = listen_host
        self.token = token
        self.clock = clock
        self.idle_timeout = idle_timeout
        self.credentials = credentials
        self.read_timeout = read_timeout

    def buildProtocol(self, addr: object) -> AdminConsole:
        proto = AdminConsole(self.ops, self.listen_host, self.token, self.clock, self.idle_timeout, self.credentials,
                             self.read_timeout)
        proto.factory = self
        return proto

"""NSQ's TCP protocol V2, sans-IO: bytes in, commands out; frames in, bytes out.

Imports no Twisted and no sockets. ``CommandParser`` turns what a client sends
into ``Command`` objects one at a time (so each command runs before the next is
parsed, as in nsqd's read loop), with nsqd's exact error codes and texts for
bad framing. The encoders build what the server sends. ``FrameReader`` and
``encode_command`` are the client's half, used by tests and tools.

Client -> server (after the 4-byte magic ``b"  V2"``)::

    <NAME>[ <param>]*\\n                                  text line, params split on " "
    [4-byte BE int32 size][size bytes]                   body, for IDENTIFY AUTH PUB DPUB
    [4-byte BE int32 size][4B num]([4B len][len B])*     MPUB (the parts are read
                                                         from the stream; size is only
                                                         range-checked, as in nsqd)

Server -> client, every frame::

    [4-byte BE size = len(data)+4][4-byte BE frame type][data]
    frame type 0 response, 1 error ("<CODE> <description>"), 2 message

Message frame data (also the record nsqd stores in its disk queues)::

    +-------------------+----------+------------------+-----------
    | 8-byte BE int64   | 2-byte   | 16-byte ASCII    | N-byte
    | timestamp (ns)    | attempts | hex message id   | body
    +-------------------+----------+------------------+-----------

Why one long module: it is the whole V2 codec (every command and frame, both directions)
with nsqd's limits and the table above.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field

from dmq_client.wire import valid_name

from dmq_server.core.nsq_errors import CloseSilently, FatalClientError, NsqError

__all__ = [
    "MAGIC_V2",
    "FRAME_RESPONSE",
    "FRAME_ERROR",
    "FRAME_MESSAGE",
    "HEARTBEAT",
    "OK",
    "CLOSE_WAIT",
    "MSG_ID_LENGTH",
    "MIN_VALID_MSG_LENGTH",
    "MAX_LINE",
    "BODY_COMMANDS",
    "Command",
    "CommandParser",
    "FrameReader",
    "frame",
    "response",
    "error_frame",
    "message_frame",
    "encode_message",
    "decode_message",
    "encode_command",
    "mpub_body",
    "parse_base10",
    "as_int64",
    "identify_body",
    "go_quote",
    "valid_name_bytes",
]

MAGIC_V2 = b"  V2"
FRAME_RESPONSE = 0
FRAME_ERROR = 1
FRAME_MESSAGE = 2
HEARTBEAT = b"_heartbeat_"
OK = b"OK"
CLOSE_WAIT = b"CLOSE_WAIT"
MSG_ID_LENGTH = 16
#: 8-byte timestamp + 2-byte attempts + 16-byte id; the smallest valid stored message.
MIN_VALID_MSG_LENGTH = 26
#: nsqd reads command lines through a 16 KiB bufio.Reader; a longer line closes the conn.
MAX_LINE = 16 * 1024
#: Commands followed by a body.
BODY_COMMANDS = frozenset({b"IDENTIFY", b"AUTH", b"PUB", b"DPUB", b"MPUB"})
_ONE_BODY = frozenset({b"PUB", b"DPUB"})  # a message body, within max_msg_size

_FRAME_HEAD = struct.Struct(">iI")
_MESSAGE_HEAD = struct.Struct(">qH16s")
_MESSAGE_FRAME_HEAD = struct.Struct(">iIqH16s")
_INT32 = struct.Struct(">i")


# -- server -> client ------------------------------------------------------------------
def frame(frame_type: int, data: bytes) -> bytes:
    """``[size][frame type][data]`` with ``size = len(data) + 4``."""
    return _FRAME_HEAD.pack(len(data) + 4, frame_type) + data


def response(data: bytes) -> bytes:
    return _FRAME_HEAD.pack(len(data) + 4, FRAME_RESPONSE) + data


def error_frame(error: NsqError) -> bytes:
    data = error.text
    return _FRAME_HEAD.pack(len(data) + 4, FRAME_ERROR) + data


def encode_message(timestamp_ns: int, attempts: int, message_id: bytes, body: bytes) -> bytes:
    """The 26-byte header and the body: a message frame's data and a disk-queue record."""
    return _MESSAGE_HEAD.pack(timestamp_ns, attempts & 0xFFFF, message_id) + body


def message_frame(timestamp_ns: int, attempts: int, message_id: bytes, body: bytes) -> bytes:
    """A whole message frame, built with one pack and one concatenation."""
    return (
        _MESSAGE_FRAME_HEAD.pack(
            len(body) + 30, FRAME_MESSAGE, timestamp_ns, attempts & 0xFFFF, message_id
        )
        + body
    )


def decode_message(data: bytes) -> tuple[int, int, bytes, bytes]:
    """``(timestamp_ns, attempts, id, body)``; ValueError below 26 bytes."""
    if len(data) < MIN_VALID_MSG_LENGTH:
        raise ValueError(f"invalid message buffer size ({len(data)})")
    timestamp, attempts, message_id = _MESSAGE_HEAD.unpack_from(data)
    return timestamp, attempts, message_id, bytes(data[MIN_VALID_MSG_LENGTH:])


# -- helpers with nsqd's exact behaviour ------------------------------------------------
def parse_base10(data: bytes) -> int:
    """nsqd's ``ByteToBase10``: ASCII digits only (no sign), an empty string is 0, and
    the value wraps like a uint64. ValueError on any other byte."""
    n = 0
    for d in data:
        if not 48 <= d <= 57:
            raise ValueError("failed to convert to Base10")
        n = (n * 10 + d - 48) & 0xFFFFFFFFFFFFFFFF
    return n


def as_int64(n: int) -> int:
    """A uint64 seen as Go's ``int64(n)``."""
    return n - (1 << 64) if n >= 1 << 63 else n


_GO_ESCAPES = {7: "\\a", 8: "\\b", 12: "\\f", 10: "\\n", 13: "\\r", 9: "\\t", 11: "\\v", 34: '\\"', 92: "\\\\"}


def go_quote(data: bytes) -> str:
    """Go's ``%q`` of a string made from ``data`` (for error texts like nsqd's)."""
    out = ['"']
    text = data.decode("utf-8", "surrogateescape")
    for ch in text:
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:  # an invalid UTF-8 byte
            out.append("\\x%02x" % (code - 0xDC00))
        elif code < 128 and code in _GO_ESCAPES:
            out.append(_GO_ESCAPES[code])
        elif code < 0x20 or code == 0x7F:
            out.append("\\x%02x" % code)
        elif not ch.isprintable():
            out.append("\\u%04x" % code if code <= 0xFFFF else "\\U%08x" % code)
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def valid_name_bytes(name: bytes) -> bool:
    """NSQ's topic/channel name rule on raw wire bytes (any non-ASCII byte fails)."""
    return valid_name(name.decode("latin-1"))


# -- client -> server: the command parser -----------------------------------------------
@dataclass(slots=True)
class Command:
    """One parsed command. ``params[0]`` is the command name, as in nsqd."""

    params: list[bytes]
    body: bytes | None = None
    bodies: list[bytes] | None = field(default=None, repr=False)

    @property
    def name(self) -> bytes:
        return self.params[0]

    @property
    def payload(self) -> bytes:
        """The body of a command that has one (IDENTIFY, AUTH, PUB, DPUB: the parser
        reads it before it hands the command on)."""
        if self.body is None:
            raise ValueError(f"{self.name!r} has no body")
        return self.body

    @property
    def payloads(self) -> list[bytes]:
        """MPUB's bodies (the parser reads them all before it hands MPUB on)."""
        if self.bodies is None:
            raise ValueError(f"{self.name!r} has no bodies")
        return self.bodies


_LINE, _SIZE, _BODY, _MPUB_COUNT, _MPUB_LEN, _MPUB_DATA, _FAILED = range(7)
#: ``FIN <16-byte id>\n``
_FIN_LINE = len(b"FIN ") + MSG_ID_LENGTH + len(b"\n")
#: a run of plain FINs: an id without a space or a newline, not ending in a carriage
#: return (the forms the steps would read as that id; ``take_fins``)
_FIN_RUN = re.compile(b"(?:FIN [^ \n]{%d}[^ \n\r]\n)+" % (MSG_ID_LENGTH - 1))


class CommandParser:
    """Feed bytes with ``receive_data``; take commands with ``next_command`` until it
    returns None (more bytes needed). Framing errors raise ``FatalClientError`` (or
    ``CloseSilently``) with nsqd's code and text; after that the parser yields nothing.

    ``precheck(params)`` runs when the line of a command with a body has been read and
    before its body is: nsqd validates state, parameters and the topic name there, so a
    bad ``PUB`` is refused without waiting for its body. It raises to refuse.
    """

    def __init__(
        self,
        max_msg_size: int = 1024 * 1024,
        max_body_size: int = 5 * 1024 * 1024,
        *,
        max_line: int = MAX_LINE,
        precheck=None,
    ):
        self.max_msg_size = max_msg_size
        self.max_body_size = max_body_size
        self.max_line = max_line
        self.precheck = precheck
        self._buf = bytearray()
        self._pos = 0
        self._state = _LINE
        self._params: list[bytes] = []
        self._need = 0
        self._count = 0
        self._bodies: list[bytes] = []
        # the whole line (with its newline) of the PUB the steps just gave, while the
        # bytes after it are its successors' to ``take_pubs``; None after anything else
        self._pub_line: bytes | None = None

    @property
    def failed(self) -> bool:
        return self._state == _FAILED

    def receive_data(self, data: bytes) -> None:
        if self._state == _FAILED:
            return
        if self._pos and self._pos * 2 >= len(self._buf):
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def buffered(self) -> int:
        """Bytes received and not yet consumed."""
        return len(self._buf) - self._pos

    def take_buffered(self) -> bytes:
        """Remove and return the unconsumed bytes (when the stream below changes, e.g. a
        compression upgrade, they must be decoded again)."""
        data = bytes(self._buf[self._pos :])
        self._buf = bytearray()
        self._pos = 0
        return data

    def next_command(self) -> Command | None:
        try:
            return self._next()
        except (NsqError, CloseSilently):
            self._state = _FAILED
            self._buf = bytearray()
            self._pos = 0
            raise

    def take_fins(self, ids: list[bytes]) -> None:
        """Take the FINs that follow whole in the input, appending their ids: a consumer
        writes a read of FINs at once, and each taken here skips a command's parse and
        dispatch. Only the plain form is taken, ``FIN`` and a 16-byte id without a space
        or a carriage return on a line of its own; anything else stops the loop, for
        ``next_command`` to read (and answer, or refuse with nsqd's error) as before."""
        if self._state != _LINE or self.max_line < _FIN_LINE:
            return
        buf = self._buf
        run = _FIN_RUN.match(buf, self._pos)  # the whole run in one call, not a loop a FIN
        if run is None:
            return
        start, end = run.span()
        ids.extend([bytes(buf[at + 4 : at + _FIN_LINE - 1]) for at in range(start, end, _FIN_LINE)])
        self._pos = end

    def take_pubs(self, bodies: list[bytes]) -> None:
        """Take the PUBs that follow whole in the input with the very line of the PUB just
        read (same topic, same spelling), appending their bodies: a producer writes a
        read of PUBs to one topic at once, and each taken here skips a command's parse,
        its checks before the body and its dispatch, which would all give the same
        answer for the same line. Anything else stops the loop (another line, a body not
        all here, a size the steps refuse), for ``next_command`` to read or refuse as
        before. Call it only right after ``next_command`` gave a PUB."""
        line = self._pub_line
        self._pub_line = None
        if line is None or self._state != _LINE:
            return
        buf, pos, largest = self._buf, self._pos, self.max_msg_size
        have, skip = len(buf), len(line)
        unpack = _INT32.unpack_from
        while have - pos >= skip + 4 and buf.startswith(line, pos):
            start = pos + skip + 4
            size = unpack(buf, start - 4)[0]
            end = start + size
            if size <= 0 or size > largest or end > have:
                break
            bodies.append(bytes(buf[start:end]))
            pos = end
        self._pos = pos

    def _take(self, n: int) -> bytes | None:
        pos = self._pos
        if len(self._buf) - pos < n:
            return None
        self._pos = pos + n
        return bytes(self._buf[pos : pos + n])

    def _take_int32(self) -> int | None:
        pos = self._pos
        if len(self._buf) - pos < 4:
            return None
        self._pos = pos + 4
        return _INT32.unpack_from(self._buf, pos)[0]

    def _next(self) -> Command | None:
        while True:
            state = self._state
            if state == _LINE:
                buf = self._buf
                self._pub_line = None
                start = self._pos
                idx = buf.find(b"\n", start)
                if idx < 0:
                    if len(buf) - self._pos >= self.max_line:
                        raise CloseSilently("command line too long")
                    return None
                if idx + 1 - self._pos > self.max_line:
                    raise CloseSilently("command line too long")
                line = bytes(buf[self._pos : idx])
                self._pos = idx + 1
                if line.endswith(b"\r"):
                    line = line[:-1]
                params = line.split(b" ")
                if params[0] not in BODY_COMMANDS:
                    return Command(params)
                if self.precheck is not None:
                    self.precheck(params)
                self._params = params
                self._state = _SIZE
                if params[0] in _ONE_BODY and len(buf) - idx > 4:
                    # a PUB (or DPUB) whose size has come with its line, nearly always
                    # with its body: taken here, not by two more turns of this loop
                    pos = idx + 1
                    size = _INT32.unpack_from(buf, pos)[0]
                    if size <= 0 or size > self.max_msg_size:
                        self._check_size(size)  # raises nsqd's error
                    end = pos + 4 + size
                    if end <= len(buf):
                        self._pos = end
                        self._state = _LINE
                        if params[0] == b"PUB":
                            self._pub_line = bytes(buf[start:pos])
                        return Command(params, bytes(buf[pos + 4 : end]))
                    self._pos = pos + 4
                    self._need = size
                    self._state = _BODY
            elif state == _SIZE:
                size = self._take_int32()
                if size is None:
                    return None
                self._check_size(size)
                if self._params[0] == b"MPUB":
                    self._state = _MPUB_COUNT
                else:
                    self._need = size
                    self._state = _BODY
            elif state == _BODY:
                body = self._take(self._need)
                if body is None:
                    return None
                self._state = _LINE
                return Command(self._params, body)
            elif state == _MPUB_COUNT:
                count = self._take_int32()
                if count is None:
                    return None
                if count <= 0 or count > (self.max_body_size - 4) // 5:
                    raise FatalClientError("E_BAD_BODY", f"MPUB invalid message count {count}")
                self._count = count
                self._bodies = []
                self._state = _MPUB_LEN
            elif state == _MPUB_LEN:
                if self._take_bodies():
                    bodies, self._bodies = self._bodies, []
                    self._state = _LINE
                    return Command(self._params, None, bodies)
                size = self._take_int32()
                if size is None:
                    return None
                i = len(self._bodies)
                if size <= 0:
                    raise FatalClientError(
                        "E_BAD_MESSAGE", f"MPUB invalid message({i}) body size {size}"
                    )
                if size > self.max_msg_size:
                    raise FatalClientError(
                        "E_BAD_MESSAGE", f"MPUB message too big {size} > {self.max_msg_size}"
                    )
                self._need = size
                self._state = _MPUB_DATA
            elif state == _MPUB_DATA:
                body = self._take(self._need)
                if body is None:
                    return None
                self._bodies.append(body)
                if len(self._bodies) == self._count:
                    bodies, self._bodies = self._bodies, []
                    self._state = _LINE
                    return Command(self._params, None, bodies)
                self._state = _MPUB_LEN
            else:  # _FAILED
                return None

    def _take_bodies(self) -> bool:
        """Take an MPUB's bodies that have arrived whole, in one loop (nearly always all
        of them: a load generator or a client library writes an MPUB in one go); True
        when the last is in. It stops before a body not fully here, or with a bad size,
        for the steps of ``_next`` to wait for it or refuse it with nsqd's error."""
        buf, pos, bodies, count, largest = self._buf, self._pos, self._bodies, self._count, self.max_msg_size
        have = len(buf)
        unpack = _INT32.unpack_from
        while len(bodies) < count and have - pos >= 4:
            size = unpack(buf, pos)[0]
            end = pos + 4 + size
            if size <= 0 or size > largest or end > have:
                break
            bodies.append(bytes(buf[pos + 4 : end]))
            pos = end
        self._pos = pos
        return len(bodies) == count

    def _check_size(self, size: int) -> None:
        name = self._params[0].decode("ascii")
        if name in ("PUB", "DPUB"):
            if size <= 0:
                raise FatalClientError("E_BAD_MESSAGE", f"{name} invalid message body size {size}")
            if size > self.max_msg_size:
                raise FatalClientError(
                    "E_BAD_MESSAGE", f"{name} message too big {size} > {self.max_msg_size}"
                )
        elif name == "MPUB":
            if size <= 0:
                raise FatalClientError("E_BAD_BODY", f"MPUB invalid body size {size}")
            if size > self.max_body_size:
                raise FatalClientError(
                    "E_BAD_BODY", f"MPUB body too big {size} > {self.max_body_size}"
                )
        else:  # IDENTIFY, AUTH
            if size > self.max_body_size:
                raise FatalClientError(
                    "E_BAD_BODY", f"{name} body too big {size} > {self.max_body_size}"
                )
            if size <= 0:
                raise FatalClientError("E_BAD_BODY", f"{name} invalid body size {size}")


# -- the client's half ------------------------------------------------------------------
def encode_command(name: bytes, *params: bytes, body: bytes | None = None) -> bytes:
    """``NAME p1 p2\\n`` and, if given, ``[size][body]``."""
    line = b" ".join((name, *params)) + b"\n"
    if body is None:
        return line
    return line + _INT32.pack(len(body)) + body


def mpub_body(bodies: list[bytes]) -> bytes:
    """MPUB's body: ``[4B num]([4B len][data])*``."""
    parts = [_INT32.pack(len(bodies))]
    for b in bodies:
        parts.append(_INT32.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


def identify_body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


class FrameReader:
    """Splits server bytes into ``(frame_type, data)`` pairs."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self._buf += data
        out = []
        buf = self._buf
        pos = 0
        while len(buf) - pos >= 8:
            size, frame_type = _FRAME_HEAD.unpack_from(buf, pos)
            if len(buf) - pos < 4 + size:
                break
            out.append((frame_type, bytes(buf[pos + 8 : pos + 4 + size])))
            pos += 4 + size
        del buf[:pos]
        return out

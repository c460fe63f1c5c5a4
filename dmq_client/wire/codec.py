"""Sans-IO codec for dmq frames: bytes in, frames out; frames in, bytes out.

No sockets, Twisted or database code here, so the server's Twisted adapter, the
blocking test client and the full client library all drive the same parser.

Frame layout (all integers big-endian)::

    0        4     5      6          8        12          20           28            36        44
    +--------+-----+------+----------+--------+-----------+------------+-------------+---------+
    | size   | cmd | type | attempts | credit | session   | message_id | timestamp   | due     |
    | u32    | u8  | u8   | u16      | u32    | i64       | i64        | i64 (ms)    | i64 (ms)|
    +--------+-----+------+----------+--------+-----------+------------+-------------+---------+
    | topic_len u8 | topic | channel_len u8 | channel | producer_len u8 | producer |
    | status_len u16 | status (UTF-8) | body (the rest of the frame) |

``size`` counts every byte after itself, so a frame is ``4 + size`` bytes.
Names are ASCII; the status is UTF-8. A frame larger than the decoder's
``max_frame_size`` is refused as soon as its size field is read, before its
bytes are buffered, so a hostile peer cannot make the reader allocate.
"""

from __future__ import annotations

import struct
import sys
from array import array

from .frames import (
    STATUS_MAX_LENGTH,
    Command,
    Frame,
    MessageType,
)

__all__ = [
    "FrameError",
    "FrameDecoder",
    "encode",
    "SendReplyEncoder",
    "PushEncoder",
    "HEADER_SIZE",
    "MIN_FRAME_SIZE",
    "DEFAULT_MAX_FRAME_SIZE",
    "frame_overhead",
    "pack_ids",
    "unpack_ids",
    "MAX_ACK_IDS",
]

_SIZE = struct.Struct(">I")
_FIXED = struct.Struct(">BBHIqqqq")
_U16 = struct.Struct(">H")

#: Bytes of the size prefix plus the fixed part.
HEADER_SIZE = _SIZE.size + _FIXED.size
#: Smallest valid value of the size field: fixed part and four empty strings.
MIN_FRAME_SIZE = _FIXED.size + 1 + 1 + 1 + 2
#: Default bound on the size field: a 1 MiB body plus room for names and status.
DEFAULT_MAX_FRAME_SIZE = 1024 * 1024 + MIN_FRAME_SIZE + 3 * 255 + STATUS_MAX_LENGTH

_I64_MIN = -(2**63)
_I64_MAX = 2**63 - 1
_COMMANDS = {int(c): c for c in Command}
_MSG_TYPES = {int(t): t for t in MessageType}


class FrameError(Exception):
    """The byte stream is not a valid dmq frame sequence.

    ``code`` is a stable machine-readable reason (E_BAD_FRAME, E_FRAME_TOO_LARGE,
    E_BAD_COMMAND, E_BAD_MSG_TYPE, E_BAD_ENCODING, E_INVALID). After it is raised
    the stream has lost framing and the connection should be closed.
    """

    def __init__(self, code: str, message: str):
        super().__init__(f"{code} {message}")
        self.code = code
        self.message = message


#: Most ids one UP_CONSUMER_ACKS frame may carry: a consumer's credit is at most a few
#: thousand, so a frame beyond this is not a batch of acks but a peer to stop.
MAX_ACK_IDS = 65536
_SWAP = sys.byteorder == "little"


def pack_ids(ids: list[int]) -> bytes:
    """The body of an UP_CONSUMER_ACKS frame: each id as a big-endian i64, in order.

    Raises FrameError (E_INVALID) for an empty batch, one above MAX_ACK_IDS, or an id that
    is not an i64. Any i64 goes, as in UP_CONSUMER_ACK's message_id: an id the server does
    not hold (0, negative: a peer's mistake) is refused there, one id at a time."""
    if not 1 <= len(ids) <= MAX_ACK_IDS:
        raise FrameError("E_INVALID", f"an ack batch holds 1..{MAX_ACK_IDS} ids, not {len(ids)}")
    try:
        packed = array("q", ids)
    except (OverflowError, TypeError):
        bad = next(i for i in ids if not isinstance(i, int) or not _I64_MIN <= i <= _I64_MAX)
        raise FrameError("E_INVALID", f"message id {bad!r} is not an integer in {_I64_MIN}..{_I64_MAX}") from None
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def unpack_ids(body: bytes) -> array[int]:
    """The ids of an UP_CONSUMER_ACKS body (``pack_ids``'s inverse). Raises FrameError
    (E_BAD_FRAME) when the body is not 1..MAX_ACK_IDS whole 8-byte ids: the sender is
    broken, and no id of such a frame can be trusted."""
    count, rest = divmod(len(body), 8)
    if rest or not 1 <= count <= MAX_ACK_IDS:
        raise FrameError(
            "E_BAD_FRAME",
            f"UP_CONSUMER_ACKS body of {len(body)} bytes is not 1..{MAX_ACK_IDS} ids of 8 bytes",
        )
    ids = array("q")
    ids.frombytes(body)
    if _SWAP:
        ids.byteswap()
    return ids


def frame_overhead(frame: Frame) -> int:
    """Bytes a frame takes on the wire besides its body."""
    return (
        MIN_FRAME_SIZE
        + _SIZE.size
        + len(frame.topic)
        + len(frame.channel)
        + len(frame.producer)
        + len(_status_bytes(frame.status))
    )


def _status_bytes(status: str) -> bytes:
    """The status as sent: UTF-8, cut to STATUS_MAX_LENGTH bytes on a character boundary."""
    try:
        raw = status.encode("utf-8")
    except UnicodeEncodeError:
        # lone surrogates (e.g. from surrogateescape) have no UTF-8 form
        raise FrameError("E_INVALID", "status is not valid Unicode text") from None
    if len(raw) > STATUS_MAX_LENGTH:
        # never split a UTF-8 sequence when truncating a long description
        raw = raw[:STATUS_MAX_LENGTH].decode("utf-8", "ignore").encode("utf-8")
    return raw


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, int) or not low <= value <= high:
        raise FrameError("E_INVALID", f"{name} {value!r} is not an integer in {low}..{high}")


def _short_str(value: str, what: str, limit: int) -> bytes:
    try:
        raw = value.encode("ascii")
    except UnicodeEncodeError:
        raise FrameError("E_INVALID", f"{what} must be ASCII") from None
    if len(raw) > limit:
        raise FrameError("E_INVALID", f"{what} longer than {limit} bytes")
    return bytes((len(raw),)) + raw


def encode(frame: Frame) -> bytes:
    """Serialise one frame. Raises FrameError (E_INVALID) for values the layout cannot
    hold and for command or message type codes the decoder would refuse.

    A status longer than STATUS_MAX_LENGTH bytes is truncated, not refused: it is a
    human-readable description.

    This runs once per message on the server's hot path, so the common case is one
    struct call and three ASCII encodes; the detailed checks run only to explain a
    failure.
    """
    try:
        fixed = _FIXED.pack(
            frame.command,
            frame.msg_type,
            frame.attempts,
            frame.credit,
            frame.session_id,
            frame.message_id,
            frame.timestamp_ms,
            frame.due_ms,
        )
        topic = frame.topic.encode("ascii")
        channel = frame.channel.encode("ascii")
        producer = frame.producer.encode("ascii")
    except (struct.error, UnicodeEncodeError, AttributeError, TypeError):
        _explain_encode_failure(frame)
        raise  # _explain_encode_failure always raises; kept for type checkers
    if frame.command not in _COMMANDS:
        raise FrameError("E_INVALID", f"unknown command {frame.command!r}")
    if frame.msg_type not in _MSG_TYPES:
        raise FrameError("E_INVALID", f"unknown message type {frame.msg_type!r}")
    # The layout holds up to 255 bytes; the name rules (valid_name) are the
    # server's to enforce, so it can answer with a specific error.
    if len(topic) > 255 or len(channel) > 255 or len(producer) > 255:
        _explain_encode_failure(frame)
    status = _status_bytes(frame.status) if frame.status else b""
    body = frame.body
    size = MIN_FRAME_SIZE + len(topic) + len(channel) + len(producer) + len(status) + len(body)
    if size > 0xFFFFFFFF:
        raise FrameError("E_INVALID", f"frame of {size} bytes does not fit the size field")
    return b"".join(
        (
            _SIZE.pack(size),
            fixed,
            _LEN1[len(topic)],
            topic,
            _LEN1[len(channel)],
            channel,
            _LEN1[len(producer)],
            producer,
            _U16.pack(len(status)),
            status,
            body,
        )
    )


_LEN1 = [bytes((n,)) for n in range(256)]


def _remember(cache: dict[tuple[str, str, str], bytes], key: tuple[str, str, str], value: bytes,
              limit: int) -> None:
    """Keep ``value``; a cache at ``limit`` starts over (peers with ever new names only
    cost a rebuild)."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value


class SendReplyEncoder:
    """The server's answer to a send (SEND_SUCCESS_ACK and the other SEND_* replies),
    byte for byte what ``encode`` makes of ``Frame(command, session_id=...,
    message_id=..., topic=..., producer=..., status=...)``, without building a Frame.

    One goes out per message, so the part after the fixed fields (topic, empty
    channel, producer, status), which a producer repeats from send to send, is kept
    per (topic, producer, status): an answer is then one struct call and one concat.
    """

    _HEAD = struct.Struct(">I" + _FIXED.format.lstrip("<>!="))
    _CACHE_LIMIT = 256
    _CACHED_STATUS = 16  # longest status whose tail is kept

    def __init__(self) -> None:
        self._tails: dict[tuple[str, str, str], bytes] = {}

    def __call__(self, command: Command, session_id: int, message_id: int, topic: str, producer: str,
                 status: str = "") -> bytes:
        tail = self._tails.get((topic, producer, status))
        if tail is None or command not in _COMMANDS:
            tail = self._tail(command, session_id, message_id, topic, producer, status)
        try:
            return self._HEAD.pack(MIN_FRAME_SIZE - 5 + len(tail), command, 0, 0, 0, session_id, message_id, 0, 0) + tail
        except struct.error:
            self._refuse(command, session_id, message_id, topic, producer, status)
            raise

    def _tail(self, command: Command, session_id: int, message_id: int, topic: str, producer: str,
              status: str) -> bytes:
        try:
            if command not in _COMMANDS:
                raise ValueError
            t, p = topic.encode("ascii"), producer.encode("ascii")
            if len(t) > 255 or len(p) > 255:
                raise ValueError
        except (UnicodeEncodeError, ValueError):
            self._refuse(command, session_id, message_id, topic, producer, status)
            raise
        raw = _status_bytes(status) if status else b""
        tail = b"".join((_LEN1[len(t)], t, _LEN1[0], _LEN1[len(p)], p, _U16.pack(len(raw)), raw))
        if len(status) <= self._CACHED_STATUS:  # "" and "duplicate"; error texts vary
            _remember(self._tails, (topic, producer, status), tail, self._CACHE_LIMIT)
        return tail

    @staticmethod
    def _refuse(command: Command, session_id: int, message_id: int, topic: str, producer: str,
                status: str) -> None:
        """Raise the FrameError ``encode`` gives for these values (the layout cannot hold one)."""
        encode(Frame(command, session_id=session_id, message_id=message_id, topic=topic,
                     producer=producer, status=status))


# the command as a plain int: struct packs an IntEnum member through __index__, which
# cost a push 130 of its 340 ns (timeit)
_CONSUMER_PUSH = int(Command.CONSUMER_PUSH)


class PushEncoder:
    """The server's CONSUMER_PUSH, byte for byte what ``encode`` makes of
    ``Frame(CONSUMER_PUSH, session_id=..., message_id=..., topic=..., channel=...,
    producer=..., timestamp_ms=..., attempts=..., status=..., body=...)``, without building
    a Frame.

    One goes out per delivery: with four channels, four per message. The names between
    the fixed fields and the body (topic, channel, producer, an empty status) repeat
    from push to push, so they are kept per (topic, channel, producer), and a push is
    one struct call and one join. A message's properties (``status``, not empty: see
    ``dmq_client.wire.properties``) replace the empty status of the kept names.
    """

    _HEAD = struct.Struct(">I" + _FIXED.format.lstrip("<>!="))
    _CACHE_LIMIT = 256

    def __init__(self) -> None:
        self._tails: dict[tuple[str, str, str], bytes] = {}

    def __call__(self, message_id: int, session_id: int, producer: str, topic: str, channel: str,
                 timestamp_ms: int, attempts: int, body: bytes, status: str = "") -> bytes:
        return b"".join(self.parts(message_id, session_id, producer, topic, channel, timestamp_ms, attempts, body,
                                   status))

    def parts(self, message_id: int, session_id: int, producer: str, topic: str, channel: str,
              timestamp_ms: int, attempts: int, body: bytes, status: str = "") -> tuple[bytes, bytes, bytes]:
        """The frame as (head, names, body), for a buffer that joins many frames at once:
        the body is then copied once, into the write, instead of twice."""
        tail = self._tails.get((topic, channel, producer))
        if tail is None:
            tail = self._tail(message_id, session_id, producer, topic, channel, timestamp_ms, attempts, body)
        if status:
            tail = self._with_status(tail, message_id, status)
        size = MIN_FRAME_SIZE - 5 + len(tail) + len(body)
        try:
            if size > 0xFFFFFFFF:
                raise struct.error
            head = self._HEAD.pack(size, _CONSUMER_PUSH, 0, attempts, 0, session_id, message_id,
                                   timestamp_ms, 0)
        except struct.error:
            self._refuse(message_id, session_id, producer, topic, channel, timestamp_ms, attempts, body, status)
            raise
        return head, tail, body

    @staticmethod
    def _with_status(tail: bytes, message_id: int, status: str) -> bytes:
        try:
            raw = status.encode("utf-8")
        except UnicodeEncodeError:
            raise FrameError("E_INVALID", "status is not valid Unicode text") from None
        if len(raw) > STATUS_MAX_LENGTH:  # properties are refused past the bound, never cut as a description
            raise FrameError("E_INVALID", f"properties of message {message_id} are over {STATUS_MAX_LENGTH} bytes")
        return b"".join((tail[:-2], _U16.pack(len(raw)), raw))

    def _tail(self, message_id: int, session_id: int, producer: str, topic: str, channel: str,
              timestamp_ms: int, attempts: int, body: bytes) -> bytes:
        try:
            names = [name.encode("ascii") for name in (topic, channel, producer)]
            if any(len(raw) > 255 for raw in names):
                raise ValueError
        except (UnicodeEncodeError, AttributeError, ValueError):
            self._refuse(message_id, session_id, producer, topic, channel, timestamp_ms, attempts, body)
            raise
        tail = b"".join(b"".join((_LEN1[len(raw)], raw)) for raw in names) + _U16.pack(0)
        _remember(self._tails, (topic, channel, producer), tail, self._CACHE_LIMIT)
        return tail

    @staticmethod
    def _refuse(message_id: int, session_id: int, producer: str, topic: str, channel: str,
                timestamp_ms: int, attempts: int, body: bytes, status: str = "") -> None:
        """Raise the FrameError ``encode`` gives for these values (the layout cannot hold one)."""
        encode(Frame(Command.CONSUMER_PUSH, session_id=session_id, message_id=message_id, topic=topic,
                     channel=channel, producer=producer, timestamp_ms=timestamp_ms, attempts=attempts,
                     status=status, body=body))


def _explain_encode_failure(frame: Frame) -> None:
    """Raise the FrameError that says which field the layout cannot hold."""
    if _COMMANDS.get(frame.command) is None:
        raise FrameError("E_INVALID", f"unknown command {frame.command!r}")
    if _MSG_TYPES.get(frame.msg_type) is None:
        raise FrameError("E_INVALID", f"unknown message type {frame.msg_type!r}")
    for name in ("session_id", "message_id", "timestamp_ms", "due_ms"):
        _check_int(name, getattr(frame, name), _I64_MIN, _I64_MAX)
    _check_int("attempts", frame.attempts, 0, 0xFFFF)
    _check_int("credit", frame.credit, 0, 0xFFFFFFFF)
    for what in ("topic", "channel", "producer"):
        _short_str(getattr(frame, what), what, 255)
    raise FrameError("E_INVALID", "frame cannot be encoded")


class FrameDecoder:
    """Incremental decoder: ``feed`` any chunking of the stream, get whole frames.

    The buffer never holds more than one incomplete frame, bounded by
    ``max_frame_size``. Once a FrameError has been raised the decoder refuses
    further input, because the stream cannot be resynchronised.
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE):
        if max_frame_size < MIN_FRAME_SIZE:
            raise ValueError(f"max_frame_size must be at least {MIN_FRAME_SIZE}")
        self.max_frame_size = max_frame_size
        self._buffer = bytearray()
        self._failed: FrameError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a whole frame."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Frame]:
        if self._failed is not None:
            # a fresh exception each time: re-raising the stored one would grow its
            # traceback with every call
            raise FrameError(self._failed.code, self._failed.message)
        buf = self._buffer
        if buf:  # the rest of a frame begun in an earlier read
            buf += data
            if len(buf) < _SIZE.size:
                return []
            (size,) = _SIZE.unpack_from(buf, 0)
            if MIN_FRAME_SIZE <= size <= self.max_frame_size and len(buf) < _SIZE.size + size:
                return []  # still incomplete: appended, not copied again (a large frame's many reads)
            data = bytes(buf)  # whole: parsed from one bytes object, as a fresh read is
            buf.clear()
        elif type(data) is not bytes:
            data = bytes(data)  # frames' bodies are bytes, whatever the caller read into
        # else parse ``data`` itself: each frame's bytes are sliced from it once, where a
        # buffer would copy every read in and every frame out twice (a read of one
        # frame is the common case for a paced producer)
        frames: list[Frame] = []
        offset = 0
        n = len(data)
        try:
            while n - offset >= _SIZE.size:
                (size,) = _SIZE.unpack_from(data, offset)
                if size > self.max_frame_size:
                    raise FrameError(
                        "E_FRAME_TOO_LARGE",
                        f"frame of {size} bytes exceeds the limit of {self.max_frame_size}",
                    )
                if size < MIN_FRAME_SIZE:
                    raise FrameError(
                        "E_BAD_FRAME", f"frame of {size} bytes is shorter than {MIN_FRAME_SIZE}"
                    )
                end = offset + _SIZE.size + size
                if n < end:
                    break
                frames.append(_decode_payload(data[offset + _SIZE.size : end]))
                offset = end
        except FrameError as exc:
            self._failed = exc
            self._buffer = bytearray()
            raise
        if offset < n:
            buf += data[offset:] if offset else data  # an incomplete frame waits for the next read
        return frames


def _decode_payload_checked(payload: bytes) -> Frame:
    """Decode one frame's bytes (after the size field). Checks every length against
    the frame's end, so a lying length field is an error, never an over-read."""
    cmd, mtype, attempts, credit, session_id, message_id, timestamp_ms, due_ms = (
        _FIXED.unpack_from(payload, 0)
    )
    command = _COMMANDS.get(cmd)
    if command is None:
        raise FrameError("E_BAD_COMMAND", f"unknown command code {cmd}")
    msg_type = _MSG_TYPES.get(mtype)
    if msg_type is None:
        raise FrameError("E_BAD_MSG_TYPE", f"unknown message type {mtype}")
    n = len(payload)
    pos = _FIXED.size
    texts = []
    for what in ("topic", "channel", "producer", "status"):
        if what == "status":
            if pos + 2 > n:
                raise FrameError("E_BAD_FRAME", f"frame ends inside the {what} length")
            length = (payload[pos] << 8) | payload[pos + 1]
            pos += 2
        else:
            if pos + 1 > n:
                raise FrameError("E_BAD_FRAME", f"frame ends inside the {what} length")
            length = payload[pos]
            pos += 1
        end = pos + length
        if end > n:
            raise FrameError(
                "E_BAD_FRAME", f"{what} length {length} runs past the end of the frame"
            )
        try:
            texts.append(payload[pos:end].decode("utf-8" if what == "status" else "ascii"))
        except UnicodeDecodeError:
            raise FrameError("E_BAD_ENCODING", f"{what} is not valid text") from None
        pos = end
    return Frame(
        command,
        session_id,
        message_id,
        texts[0],
        texts[1],
        texts[2],
        msg_type,
        due_ms,
        timestamp_ms,
        attempts,
        credit,
        texts[3],
        payload[pos:],
    )


_unpack_fixed = _FIXED.unpack_from
_FIXED_SIZE = _FIXED.size


def _decode_payload(payload: bytes) -> Frame:
    """Hot-path decoder: straight-line reads, and on anything unusual the checked
    decoder above runs instead to raise the precise FrameError."""
    try:
        cmd, mtype, attempts, credit, session_id, message_id, timestamp_ms, due_ms = _unpack_fixed(
            payload, 0
        )
        n = len(payload)
        p = _FIXED_SIZE + 1
        e = p + payload[p - 1]
        topic = payload[p:e].decode("ascii")
        p = e + 1
        e = p + payload[p - 1]
        channel = payload[p:e].decode("ascii")
        p = e + 1
        e = p + payload[p - 1]
        producer = payload[p:e].decode("ascii")
        p = e + 2
        e = p + ((payload[p - 2] << 8) | payload[p - 1])
        if e > n:
            raise IndexError
        status = payload[p:e].decode("utf-8") if e > p else ""
        return Frame(
            _COMMANDS[cmd],
            session_id,
            message_id,
            topic,
            channel,
            producer,
            _MSG_TYPES[mtype],
            due_ms,
            timestamp_ms,
            attempts,
            credit,
            status,
            payload[e:],
        )
    except (IndexError, KeyError, UnicodeDecodeError):
        return _decode_payload_checked(payload)

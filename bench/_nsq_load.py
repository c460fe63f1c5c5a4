"""NSQ protocol V2 load generators on raw sockets: PUB or MPUB producers, RDY/FIN consumers.

The same generator runs against dmq's fast path and against nsqd (bench/nsq.py), so
any difference in the figures is the server's. Like ``_dmq_load`` it does little per
message: the command bytes are built once and only the body's first 8 bytes (the send
time, ``time.time_ns()``, for publish->delivery latency) change per refill; replies are
read in large ``recv`` calls and scanned in place.

Wire (nsqd's protocol V2): the client sends ``"  V2"``; ``PUB <topic>\\n`` + 4-byte size
+ body; ``MPUB <topic>\\n`` + 4-byte size + 4-byte count + (4-byte size + body) each;
``SUB <topic> <channel>\\n``, ``RDY <n>\\n``, ``FIN <16-byte id>\\n``, ``NOP\\n``. The server
answers with frames: 4-byte size, 4-byte type (0 response, 1 error, 2 message), data.
Responses answer commands in order, one ``OK`` per PUB or MPUB. A message frame's data
is an 8-byte timestamp, 2-byte attempts, 16-byte id and the body. A ``_heartbeat_``
response is answered with ``NOP`` and not counted.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from array import array
from typing import Any

from _common import run_worker

MAGIC = b"  V2"
U32 = struct.Struct(">I")
I64 = struct.Struct(">q")
FRAME_RESPONSE, FRAME_ERROR, FRAME_MESSAGE = 0, 1, 2
HEARTBEAT = b"_heartbeat_"
RECV_SIZE = 1 << 20


def _connect(host: str, port: int) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(MAGIC)
    return sock


class Frames:
    """Frames scanned in place from a growing buffer."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int, int]]:
        """(type, data start, data end) offsets into ``self.buf`` of every whole frame; call ``consumed()`` after."""
        self.buf += data
        out = []
        buf, pos, blen = self.buf, 0, len(self.buf)
        while blen - pos >= 8:
            end = pos + 4 + U32.unpack_from(buf, pos)[0]
            if end > blen:
                break
            out.append((U32.unpack_from(buf, pos + 4)[0], pos + 8, end))
            pos = end
        self._pos = pos
        return out

    def consumed(self) -> None:
        if self._pos:
            del self.buf[: self._pos]


def _response(sock: socket.socket, frames: Frames, what: str) -> None:
    """Read until one OK (answering heartbeats); raise on an error frame."""
    while True:
        data = sock.recv(RECV_SIZE)
        if not data:
            raise ConnectionError(f"server closed the connection after {what}")
        found = frames.feed(data)
        for kind, start, end in found:
            body = bytes(frames.buf[start:end])
            if kind == FRAME_ERROR:
                raise ConnectionError(f"{what}: {body.decode(errors='replace')}")
            if kind == FRAME_RESPONSE and body == HEARTBEAT:
                sock.sendall(b"NOP\n")
                continue
            if kind == FRAME_RESPONSE and body == b"OK":
                frames.consumed()
                return
        frames.consumed()


# ---------------------------------------------------------------- producer


def producer_main(cfg: dict, index: int, ready_q: Any, start_evt: Any, result_q: Any) -> None:
    """cfg: host, port, topic, n, window (messages unanswered), batch (1 = PUB, else MPUB of batch), body_size,
    timeout."""
    run_worker("producer", _producer, cfg, index, ready_q, start_evt, result_q)


def _producer(cfg: dict, index: int, ready_q: Any, start_evt: Any, result: dict) -> None:
    n, batch = cfg["n"], max(1, cfg.get("batch", 1))
    # commands in flight: PUB: window of them; MPUB: as many batches as cover the window
    window = max(1, -(-cfg["window"] // batch))
    topic = cfg["topic"].encode()
    filler = b"\x00" * (cfg["body_size"] - 8)
    size = U32.pack(cfg["body_size"])
    perf = time.perf_counter
    counts = [batch] * (n // batch) + ([n % batch] if n % batch else [])

    def command(count: int, body: bytes) -> bytes:
        if batch == 1:
            return b"PUB " + topic + b"\n" + size + body
        payload = U32.pack(count) + (size + body) * count
        return b"MPUB " + topic + b"\n" + U32.pack(len(payload)) + payload

    sock = _connect(cfg["host"], cfg["port"])
    ready_q.put(("ready", index, None))
    if not start_evt.wait(120):
        raise RuntimeError("start signal never came")
    sock.settimeout(None)
    frames = Frames()
    sent_at = array("d", bytes(8 * len(counts)))
    lat = array("d")  # per command: write to its OK
    next_cmd = answered = acked = 0
    t_start = time.time()
    deadline = perf() + cfg["timeout"]
    while answered < len(counts):
        if perf() > deadline:
            raise TimeoutError(f"only {acked} of {n} messages answered within {cfg['timeout']}s")
        k = min(len(counts) - next_cmd, window - (next_cmd - answered))
        if k > 0:
            body = time.time_ns().to_bytes(8, "big", signed=True) + filler
            data = b"".join(command(counts[c], body) for c in range(next_cmd, next_cmd + k))
            t = perf()
            for c in range(next_cmd, next_cmd + k):
                sent_at[c] = t
            sock.sendall(data)
            next_cmd += k
        data = sock.recv(RECV_SIZE)
        if not data:
            raise ConnectionError("server closed the connection")
        now = perf()
        found = frames.feed(data)
        for kind, start, end in found:
            if kind == FRAME_RESPONSE:
                if end - start == 2:  # OK
                    lat.append(now - sent_at[answered])
                    acked += counts[answered]
                    answered += 1
                else:  # _heartbeat_
                    sock.sendall(b"NOP\n")
            else:
                raise ConnectionError(f"frame type {kind}: {bytes(frames.buf[start:end]).decode(errors='replace')}")
        frames.consumed()
    t_end = time.time()
    sock.close()
    result.update(sent=n, acked=acked, failed=0, t_start=t_start, t_end=t_end, lat=lat.tobytes())


# ---------------------------------------------------------------- consumer


def consumer_main(cfg: dict, index: int, ready_q: Any, start_evt: Any, result_q: Any) -> None:
    """cfg: host, port, topic, channel, rdy, expected, timeout."""
    run_worker("consumer", _consumer, cfg, index, ready_q, start_evt, result_q)


def _consumer(cfg: dict, index: int, ready_q: Any, start_evt: Any, result: dict) -> None:
    expected = cfg["expected"]
    sock = _connect(cfg["host"], cfg["port"])
    frames = Frames()
    sock.sendall(b"SUB " + cfg["topic"].encode() + b" " + cfg["channel"].encode() + b"\n")
    _response(sock, frames, "SUB")
    ready_q.put(("ready", index, None))
    if not start_evt.wait(120):
        raise RuntimeError("start signal never came")
    sock.settimeout(None)
    t_start = time.time()
    sock.sendall(b"RDY " + str(cfg["rdy"]).encode() + b"\n")
    seen: set[bytes] = set()
    lat = array("d")
    received = duplicates = 0
    t_first = t_last = 0.0
    deadline = time.monotonic() + cfg["timeout"]
    pending = list(frames.feed(b""))
    while len(seen) < expected:
        if pending:
            found, pending = pending, []
        else:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"received {len(seen)} of {expected} messages within {cfg['timeout']}s")
            readable, _, _ = select.select([sock], [], [], min(remaining, 0.5))
            if not readable:
                continue
            data = sock.recv(RECV_SIZE)
            if not data:
                raise ConnectionError("server closed the connection")
            found = frames.feed(data)
        now_ns = time.time_ns()
        buf = frames.buf
        fins = []
        for kind, start, end in found:
            if kind == FRAME_MESSAGE:
                mid = bytes(buf[start + 10 : start + 26])
                fins.append(b"FIN " + mid + b"\n")
                if mid in seen:
                    duplicates += 1
                else:
                    seen.add(mid)
                    lat.append((now_ns - I64.unpack_from(buf, start + 26)[0]) / 1e9)
            elif kind == FRAME_RESPONSE:
                sock.sendall(b"NOP\n")  # _heartbeat_ (a consumer's commands get no OK)
            else:
                raise ConnectionError(f"error frame: {bytes(buf[start:end]).decode(errors='replace')}")
        frames.consumed()
        if fins:
            if not t_first:
                t_first = time.time()
            received += len(fins)
            sock.sendall(b"".join(fins))
            t_last = time.time()
    # CLS is answered with CLOSE_WAIT after every FIN before it has been handled
    sock.sendall(b"CLS\n")
    sock.settimeout(10)
    closing = True
    while closing:
        data = sock.recv(RECV_SIZE)
        if not data:
            break
        for kind, start, end in frames.feed(data):
            closing = closing and not (kind == FRAME_RESPONSE and frames.buf[start:end] == b"CLOSE_WAIT")
        frames.consumed()
    sock.close()
    result.update(received=received, unique=len(seen), duplicates=duplicates, acked=received, t_start=t_start,
                  t_first=t_first, t_last=t_last, lat=lat.tobytes())

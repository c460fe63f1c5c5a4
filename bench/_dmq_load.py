"""dmq load generators: producer and consumer processes on raw sockets.

Everything shares two cores with the server and PostgreSQL, so the generators
do as little as possible per message: each producer encodes one template frame
with the wire codec, then only splices in the session id and timestamps; frames
go out in one ``sendall`` per window refill; replies and pushes are read in
large ``recv`` calls and scanned in place for the few fields needed (command,
session id, message id, the body's first 8 bytes). The templates are checked
against the codec's decoder at start, so a layout change fails loudly instead
of measuring garbage.

Each worker runs in its own process (multiprocessing, fork), connects and
reports ready, waits for the common start event, runs, and puts a result dict
on the result queue: counts, wall-clock start/end (time.time()), its own CPU
seconds, and latencies in seconds as raw ``array('d')`` bytes.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from array import array
from typing import Any, Sequence

from _common import run_worker

from dmq_client.wire import MAGIC, Command, Frame, FrameDecoder, encode, pack_ids, unpack_ids
from dmq_client.wire.codec import MAX_ACK_IDS
from dmq_client.wire.properties import Properties, encode_properties

U32 = struct.Struct(">I")
U16 = struct.Struct(">H")
I64 = struct.Struct(">q")

# offsets inside an encoded frame (see dmq_client/wire/codec.py)
OFF_CMD = 4
OFF_SESSION = 12
OFF_MESSAGE_ID = 20
OFF_TIMESTAMP = 28
OFF_TOPIC_LEN = 44

C_SEND_SUCCESS = int(Command.SEND_SUCCESS_ACK)
C_PUSH = int(Command.CONSUMER_PUSH)
C_SUB_ACK = int(Command.SUBSCRIBE_ACK)
C_PROTOCOL_ERROR = int(Command.PROTOCOL_ERROR)
SEND_FAILURES = {
    int(Command.SEND_NO_TOPIC_ACK),
    int(Command.SEND_SERVER_ERROR),
    int(Command.SEND_EXCEED_LIMIT_ACK),
    int(Command.SEND_INVALID_ACK),
}
SUB_FAILURES = {
    int(Command.SUBSCRIBE_NO_TOPIC_ACK),
    int(Command.SUBSCRIBE_NO_CLIENT_ID_ACK),
    int(Command.SUBSCRIBE_SERVER_ERROR),
    int(Command.SUBSCRIBE_INVALID_ACK),
}

RECV_SIZE = 1 << 20


class SendTemplate:
    """An encoded UP_PRODUCER_SEND split around the bytes that change per message."""

    def __init__(self, topic: str, producer: str, body_size: int, status: str = "", tag: int = 0):
        if body_size < 8 or (tag and body_size < 9):
            raise ValueError("bodies carry an 8-byte send time (and a tag byte after it); body_size must be >= 8 (9)")
        # ``status``: the messages' properties (docs/protocol.md §4.15), the same for each;
        # ``tag``: the body's 9th byte, which a consumer with cfg["latency_tags"] reads (bench/ordered_nodes.py:
        # the node a copy was sent to)
        raw = encode(
            Frame(Command.UP_PRODUCER_SEND, session_id=0, topic=topic, producer=producer, status=status,
                  body=(b"\x00" * 8 + bytes([tag])).ljust(body_size, b"\x00")[:body_size])
        )
        body_off = len(raw) - body_size
        self.head = raw[:OFF_SESSION]
        self.between_ts = raw[OFF_SESSION + 8 : OFF_TIMESTAMP]
        self.before_body = raw[OFF_TIMESTAMP + 8 : body_off]
        self.body_rest = raw[body_off + 8 :]
        # self-check against the codec
        probe = self.frame(12345, 1_700_000_000_000, 1_700_000_000_000_000_000)
        (frame,) = FrameDecoder().feed(probe)
        assert frame.command == Command.UP_PRODUCER_SEND and frame.session_id == 12345
        assert frame.topic == topic and frame.producer == producer and frame.timestamp_ms == 1_700_000_000_000
        assert frame.status == status
        assert len(frame.body) == body_size and I64.unpack_from(frame.body, 0)[0] == 1_700_000_000_000_000_000

    def suffix(self, now_ms: int, now_ns: int) -> bytes:
        """Everything after the session id, for messages sent at this moment."""
        return self.between_ts + I64.pack(now_ms) + self.before_body + I64.pack(now_ns) + self.body_rest

    def frame(self, session_id: int, now_ms: int, now_ns: int) -> bytes:
        return self.head + I64.pack(session_id) + self.suffix(now_ms, now_ns)


def key_names(count: int) -> list[str]:
    """``count`` keys of one width (``k00000``...): their statuses are of one length, so a
    keyed template splices a key's status in without re-encoding the frame."""
    if count < 1:
        raise ValueError("a keyed run needs at least one key")
    width = max(5, len(str(count - 1)))
    return [f"k{i:0{width}d}" for i in range(count)]


def hot_key_name(count: int) -> str:
    """The hot key of ``--hot-key-share``: as wide as ``key_names(count)``'s, never one of them."""
    return "h" + key_names(count)[0][1:]


def key_status(key: str) -> str:
    """The status of a send carrying ``key`` and nothing else (docs/protocol.md §4.15)."""
    return encode_properties(Properties(key=key))


def key_plan(n: int, keys: int, offset: int, stride: int, hot_share: float = 0.0) -> array:
    """For each of a producer's ``n`` messages, the index of its key: ``keys`` (one past the
    last plain key) is the hot key.

    The plain keys are taken ``offset, offset + stride, ...`` round the ``keys`` of the run,
    so producers ``0..stride-1`` with their own offsets share the keys evenly and
    consecutive messages of a producer differ in key (with more than one key). With
    ``hot_share`` S, a message is the hot key's whenever ``int((j + 1) * S)`` steps, which
    spreads the hot key's messages evenly among the rest (S = 0.5: every other one).
    """
    if not 0.0 <= hot_share <= 1.0:
        raise ValueError(f"hot_share {hot_share} is outside 0..1")
    plan = array("l", bytes(array("l").itemsize * n))
    plain = 0
    for j in range(n):
        if hot_share and int((j + 1) * hot_share) > int(j * hot_share):
            plan[j] = keys
        else:
            plan[j] = (offset + plain * stride) % keys
            plain += 1
    return plan


class KeyedSendTemplate(SendTemplate):
    """A SendTemplate whose status, the message's key, is spliced in per message.

    ``keys`` must encode to statuses of one length (``key_names`` gives such keys): the
    frame's size and status length fields are then the same for every key, and a frame is
    the template's bytes with the chosen key's status bytes in place of the first's.
    """

    def __init__(self, topic: str, producer: str, body_size: int, keys: Sequence[str], tag: int = 0):
        statuses = [key_status(k).encode() for k in keys]
        if not statuses:
            raise ValueError("a keyed template needs at least one key")
        if len({len(s) for s in statuses}) != 1:
            raise ValueError("keys of a KeyedSendTemplate must encode to statuses of one length")
        super().__init__(topic, producer, body_size, statuses[0].decode(), tag)
        # the status is the last thing before the body (docs/protocol.md §2)
        self.statuses = statuses
        self.before_status = self.before_body[: -len(statuses[0])]
        for index in {0, len(keys) - 1}:  # the layout is the same for every key; a check at both ends
            (frame,) = FrameDecoder().feed(self.keyed_frame(99, 1_700_000_000_000, 7, index))
            assert frame.session_id == 99 and frame.topic == topic and frame.status == statuses[index].decode()
            assert I64.unpack_from(frame.body, 0)[0] == 7 and len(frame.body) == body_size

    def around_status(self, now_ms: int, now_ns: int) -> tuple[bytes, bytes]:
        """What goes between the session id and the status, and after the status, for
        messages sent at this moment."""
        return (self.between_ts + I64.pack(now_ms) + self.before_status,
                I64.pack(now_ns) + self.body_rest)

    def frames(self, first_session_id: int, key_indices: Sequence[int], now_ms: int, now_ns: int) -> bytes:
        """Consecutive sends, session ids from ``first_session_id``, the i-th with the key
        ``key_indices[i]`` (an index into ``keys``), all sent at this moment."""
        before, after = self.around_status(now_ms, now_ns)
        head, pack, statuses = self.head, I64.pack, self.statuses
        parts: list[bytes] = []
        append = parts.append
        for sid, key_index in enumerate(key_indices, first_session_id):
            append(head)
            append(pack(sid))
            append(before)
            append(statuses[key_index])
            append(after)
        return b"".join(parts)

    def keyed_frame(self, session_id: int, now_ms: int, now_ns: int, key_index: int) -> bytes:
        return self.frames(session_id, (key_index,), now_ms, now_ns)


PRIORITY_LEVELS = 10  # 0 to 9 (docs/protocol.md §4.15)


def priority_plan(n: int, mixed: bool, seed: int) -> array:
    """For each of a producer's ``n`` messages, its priority: with ``mixed`` each of 0 to 9
    equally likely (a seeded draw, the same in every run of a seed), else 0 for all."""
    import random

    if not mixed:
        return array("b", bytes(n))
    draw = random.Random(seed).randrange
    return array("b", (draw(PRIORITY_LEVELS) for _ in range(n)))


class PrioritySendTemplates:
    """A SendTemplate per priority: the frames of consecutive sends, each with the status of
    its priority (none for 0, as an old client's). Statuses of 0 and 1-9 differ in length,
    so each priority has its whole template rather than a status spliced into one."""

    def __init__(self, topic: str, producer: str, body_size: int):
        self.templates = [SendTemplate(topic, producer, body_size, encode_properties(Properties(priority=p)))
                          for p in range(PRIORITY_LEVELS)]
        self.head = self.templates[0].head

    def frames(self, first_session_id: int, priorities: Sequence[int], now_ms: int, now_ns: int) -> bytes:
        """Consecutive sends, session ids from ``first_session_id``, the i-th of priority
        ``priorities[i]``, all sent at this moment."""
        heads = [t.head for t in self.templates]
        suffixes = [t.suffix(now_ms, now_ns) for t in self.templates]
        pack = I64.pack
        parts: list[bytes] = []
        append = parts.append
        for sid, priority in enumerate(priorities, first_session_id):
            append(heads[priority])
            append(pack(sid))
            append(suffixes[priority])
        return b"".join(parts)


PRIORITY_FIELD = b'"priority":'


def status_priority(status: bytes | bytearray) -> int:
    """The priority a push's status carries (0 when it has none): the digit after
    ``"priority":`` in the JSON object the server writes (docs/protocol.md §4.15)."""
    at = status.find(PRIORITY_FIELD)
    if at < 0:
        return 0
    return status[at + len(PRIORITY_FIELD)] - 48  # one digit, 0 to 9


def push_status_span(buf: bytes | bytearray, pos: int) -> tuple[int, int]:
    """Where the status of the push frame at ``pos`` starts and ends (the body follows it)."""
    p = pos + OFF_TOPIC_LEN
    p += 1 + buf[p]  # topic
    p += 1 + buf[p]  # channel
    p += 1 + buf[p]  # producer
    return p + 2, p + 2 + U16.unpack_from(buf, p)[0]


class AckTemplate:
    """Acks for a list of ids: one UP_CONSUMER_ACKS frame per MAX_ACK_IDS (as the client
    library sends them), or with ``single`` one UP_CONSUMER_ACK per id (as before that
    frame, and as a client reading one push at a time)."""

    def __init__(self, topic: str, channel: str, single: bool = False):
        self.topic, self.channel, self.single = topic, channel, single
        raw = encode(Frame(Command.UP_CONSUMER_ACK, topic=topic, channel=channel, message_id=0))
        self.head = raw[:OFF_MESSAGE_ID]
        self.tail = raw[OFF_MESSAGE_ID + 8 :]
        (frame,) = FrameDecoder().feed(self.head + I64.pack(77) + self.tail)
        assert frame.command == Command.UP_CONSUMER_ACK and frame.message_id == 77
        assert frame.topic == topic and frame.channel == channel
        frames = FrameDecoder().feed(self.frames([77, 78]))
        if single:
            assert [(f.command, f.message_id) for f in frames] == [(Command.UP_CONSUMER_ACK, 77),
                                                                   (Command.UP_CONSUMER_ACK, 78)]
        else:
            (frame,) = frames
            assert frame.command == Command.UP_CONSUMER_ACKS and list(unpack_ids(frame.body)) == [77, 78]

    def frames(self, ids: list[int]) -> bytes:
        if self.single:
            head, tail, pack = self.head, self.tail, I64.pack
            return b"".join(head + pack(mid) + tail for mid in ids)
        return b"".join(
            encode(Frame(Command.UP_CONSUMER_ACKS, topic=self.topic, channel=self.channel,
                         body=pack_ids(ids[i : i + MAX_ACK_IDS])))
            for i in range(0, len(ids), MAX_ACK_IDS)
        )


def _status_of(buf: bytes | bytearray, pos: int, end: int) -> str:
    """Decode one whole frame with the real codec (for error replies only)."""
    try:
        (frame,) = FrameDecoder().feed(bytes(buf[pos:end]))
        return f"{frame.command.name} {frame.status}"
    except Exception as exc:  # noqa: BLE001
        return f"undecodable frame: {exc}"


def _connect(host: str, port: int, tls_ca: str | None = None) -> socket.socket:
    """A connection that sent the magic; with ``tls_ca``, TLS to the server's TLS port
    (bench/tls.py: the generator is single-threaded, so a plain SSLSocket does)."""
    sock = socket.create_connection((host, port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 21)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 21)
    if tls_ca:
        import ssl

        sock = ssl.create_default_context(cafile=tls_ca).wrap_socket(sock, server_hostname=host)
    sock.sendall(MAGIC)
    return sock


# ---------------------------------------------------------------- producer


def producer_main(cfg: dict, index: int, ready_q: Any, start_evt: Any, result_q: Any) -> None:
    """One producer connection.

    cfg: host, port, topic, n (messages for this producer), window, body_size,
    rate (msgs/s for this producer, 0 = as fast as the window allows; paced, the result's
    ``lat_sched`` holds each reply's latency from the time its send was due, parallel to
    ``lat``, from the time it was written),
    timeout (seconds after start), producer (name); tag (0-255, the body's 9th byte: see
    the consumer's latency_tags).
    """
    run_worker("producer", _producer, cfg, index, ready_q, start_evt, result_q)


def _producer(cfg: dict, index: int, ready_q: Any, start_evt: Any, result: dict) -> None:
    n = cfg["n"]
    window = cfg["window"]
    rate = float(cfg.get("rate") or 0.0)
    keys = cfg.get("keys", 0)
    hot_share = cfg.get("hot_share", 0.0)
    keyed: KeyedSendTemplate | PrioritySendTemplates | None = None
    if keys:  # each message carries a key of the run's (docs/benchmarks.md, the ordered scenario)
        names = key_names(keys) + ([hot_key_name(keys)] if hot_share else [])
        tmpl = keyed = KeyedSendTemplate(cfg["topic"], cfg["producer"], cfg["body_size"], names, cfg.get("tag", 0))
        plan = key_plan(n, keys, cfg.get("key_offset", index), cfg.get("key_stride", 1), hot_share)
    elif cfg.get("priorities") is not None:  # each message its priority (the priority scenario)
        tmpl = keyed = PrioritySendTemplates(cfg["topic"], cfg["producer"], cfg["body_size"])
        plan = cfg["priorities"]
    else:
        tmpl = SendTemplate(cfg["topic"], cfg["producer"], cfg["body_size"], cfg.get("status", ""), cfg.get("tag", 0))
    head = tmpl.head
    pack = I64.pack
    u32_from = U32.unpack_from
    i64_from = I64.unpack_from
    perf = time.perf_counter

    sock = _connect(cfg["host"], cfg["port"], cfg.get("tls_ca"))
    ready_q.put(("ready", index, None))
    if not start_evt.wait(120):
        raise RuntimeError("start signal never came")
    sock.settimeout(None)

    sent_at = array("d", bytes(8 * n))
    lat = array("d")
    lat_sched = array("d")  # paced: from the time each send was due (p_start + seq / rate)
    ack_at = array("d")  # seconds after this producer's start, parallel to lat
    sid0 = 1  # session ids 1..n (must be >= 0)
    next_seq = 0
    acked = 0
    failed = 0
    first_error = None
    window_full = 0  # paced mode: times a due send had to wait for the window
    buf = bytearray()
    t_start = time.time()
    p_start = perf()
    deadline = p_start + cfg["timeout"]

    while acked + failed < n:
        now = perf()
        if now > deadline:
            raise TimeoutError(f"only {acked + failed} of {n} sends answered within {cfg['timeout']}s")
        outstanding = next_seq - acked - failed
        if rate:
            due = min(n, int((now - p_start) * rate) + 1)
            k = min(due - next_seq, window - outstanding)
            if due > next_seq and k <= 0:
                window_full += 1
        else:
            k = min(n - next_seq, window - outstanding)
        if k > 0:
            parts = []
            append = parts.append
            if keyed is None:
                suffix = tmpl.suffix(int(time.time() * 1000), time.time_ns())
                for sid in range(next_seq + sid0, next_seq + sid0 + k):
                    append(head)
                    append(pack(sid))
                    append(suffix)
            else:
                parts.append(keyed.frames(next_seq + sid0, plan[next_seq : next_seq + k], int(time.time() * 1000),
                                          time.time_ns()))
            data = b"".join(parts)
            t_write = perf()
            for seq in range(next_seq, next_seq + k):
                sent_at[seq] = t_write
            sock.sendall(data)
            next_seq += k
        if rate:
            # sleep until the next send is due or a reply arrives
            outstanding = next_seq - acked - failed
            if next_seq < n and outstanding < window:
                wait = max(0.0, p_start + next_seq / rate - perf())
            else:
                wait = 1.0
            if wait > 0 or outstanding:
                readable, _, _ = select.select([sock], [], [], wait)
                if not readable:
                    continue
            else:
                continue
        data = sock.recv(RECV_SIZE)
        if not data:
            raise ConnectionError("server closed the connection")
        now = perf()
        buf += data
        pos = 0
        blen = len(buf)
        while blen - pos >= 4:
            end = pos + 4 + u32_from(buf, pos)[0]
            if end > blen:
                break
            cmd = buf[pos + OFF_CMD]
            if cmd == C_SEND_SUCCESS:
                seq = i64_from(buf, pos + OFF_SESSION)[0] - sid0
                lat.append(now - sent_at[seq])
                ack_at.append(now - p_start)
                if rate:
                    lat_sched.append(now - p_start - seq / rate)
                acked += 1
            elif cmd in SEND_FAILURES:
                failed += 1
                if first_error is None:
                    first_error = _status_of(buf, pos, end)
            elif cmd == C_PROTOCOL_ERROR:
                raise ConnectionError(_status_of(buf, pos, end))
            pos = end
        if pos:
            del buf[:pos]
    t_end = time.time()
    sock.close()
    result.update(
        sent=next_seq,
        acked=acked,
        failed=failed,
        first_error=first_error,
        window_full=window_full,
        t_start=t_start,
        t_end=t_end,
        lat=lat.tobytes(),
        lat_sched=lat_sched.tobytes(),
        ack_at=ack_at.tobytes(),
    )


# ---------------------------------------------------------------- consumer


def consumer_main(cfg: dict, index: int, ready_q: Any, start_evt: Any, result_q: Any) -> None:
    """One consumer subscription.

    cfg: host, port, topic, channel, credit, single_acks (one UP_CONSUMER_ACK per push,
    not one UP_CONSUMER_ACKS per read), expected (unique messages to wait for, 0 = no target), timeout (seconds after start), phases: list of
    (seconds or None, ack: bool); None = until ``expected`` is reached.
    Records publish->delivery latency from the body's first 8 bytes
    (producer time.time_ns()) when cfg["latency"]; with cfg["latency_tags"] also each
    latency's body tag (its 9th byte, ``lat_tags``, parallel to ``lat``).

    Several consumers of one channel: cfg["shared"], a multiprocessing Value('q') they all
    add their new messages to; each stops once it reaches ``expected`` (the channel's
    messages). cfg["hot_status"]: the status bytes of the hot key (``--hot-key-share``):
    each push's status is compared with it, hot and other messages are counted apart
    (``hot``, ``cold``, and per read ``reads``: time, cold, hot) and ``expected`` counts
    the other keys' messages only. cfg["partial"]: at the timeout, stop and report what
    came instead of failing (how far a stalled channel got). cfg["record_priority"]: each
    new message's id and priority in the order pushed (``order_ids``, ``order_priorities``;
    ``order_times``: each read's time and how many had come by then),
    and when the subscription went out and its first push came (``t_subscribe``,
    ``t_first_push``: pushes may come before the common start).
    """
    run_worker("consumer", _consumer, cfg, index, ready_q, start_evt, result_q)


def _consumer(cfg: dict, index: int, ready_q: Any, start_evt: Any, result: dict) -> None:
    topic, channel = cfg["topic"], cfg["channel"]
    acks = AckTemplate(topic, channel, single=cfg.get("single_acks", False))
    u32_from = U32.unpack_from
    i64_from = I64.unpack_from
    want_latency = cfg.get("latency", True)
    lat_tags = array("B") if cfg.get("latency_tags") else None
    expected = cfg.get("expected", 0)
    shared = cfg.get("shared")
    hot_status: bytes | None = cfg.get("hot_status")
    partial = cfg.get("partial", False)
    record_priority = cfg.get("record_priority", False)
    order_ids = array("q")
    order_priorities = array("b")
    order_times = array("d")  # with record_priority: per read that brought new ones, its time and count so far
    t_first_push = 0.0

    sock = _connect(cfg["host"], cfg["port"])
    t_subscribe = time.time()
    sock.sendall(
        encode(Frame(Command.UP_SUBSCRIBE, session_id=1, topic=topic, channel=channel, credit=cfg["credit"]))
    )
    pending = b""
    subscribed = False
    while not subscribed:  # read frame by frame until SUBSCRIBE_ACK; keep what follows
        data = sock.recv(RECV_SIZE)
        if not data:
            raise ConnectionError("server closed the connection before SUBSCRIBE_ACK")
        # pushes may follow the ack in the same read: keep them
        chunk = pending + data
        pos = 0
        while len(chunk) - pos >= 4:
            end = pos + 4 + u32_from(chunk, pos)[0]
            if end > len(chunk):
                break
            cmd = chunk[pos + OFF_CMD]
            if not subscribed:
                if cmd == C_SUB_ACK:
                    subscribed = True
                    pos = end
                    break
                if cmd in SUB_FAILURES or cmd == C_PROTOCOL_ERROR:
                    raise ConnectionError(f"subscribe refused: {_status_of(chunk, pos, end)}")
            pos = end
        pending = chunk[pos:]
    if pending:  # (a push's first bytes at least)
        t_first_push = time.time()
    ready_q.put(("ready", index, None))
    if not start_evt.wait(120):
        raise RuntimeError("start signal never came")

    buf = bytearray(pending)
    seen: set[int] = set()
    lat = array("d")
    received = 0
    acked = 0
    duplicates = 0
    t_start = time.time()
    t_first = t_last = 0.0
    overall_deadline = time.monotonic() + cfg["timeout"]
    phase_log = []
    held: list[int] = []  # received, not yet acknowledged (no-ack phases)
    counted = 0  # towards ``expected``: new messages (with hot_status, of the other keys)
    hot = cold = 0
    reads = array("d")  # with hot_status: time, cold, hot of each read that brought some
    timed_out = False
    for seconds, do_ack in cfg.get("phases") or [(None, True)]:
        phase_start = time.time()
        phase_received = phase_acked = 0
        phase_deadline = overall_deadline if seconds is None else min(overall_deadline, time.monotonic() + seconds)
        if do_ack and held:
            sock.sendall(acks.frames(held))
            acked += len(held)
            phase_acked += len(held)
            held = []
            t_last = time.time()
        while True:
            if seconds is None and expected and (shared.value if shared is not None else counted) >= expected:
                break
            remaining = phase_deadline - time.monotonic()
            if remaining <= 0:
                if seconds is None and not partial:
                    raise TimeoutError(f"received {len(seen)} of {expected} messages within {cfg['timeout']}s")
                timed_out = seconds is None
                break
            # sharing a channel, a consumer may have nothing more to read when the others
            # finish: look at the shared count often
            readable, _, _ = select.select([sock], [], [], min(remaining, 0.5 if shared is None else 0.02))
            if not readable:
                continue
            data = sock.recv(RECV_SIZE)
            if not data:
                raise ConnectionError("server closed the connection")
            now_ns = time.time_ns()
            buf += data
            pos = 0
            blen = len(buf)
            ids = []
            fresh = read_hot = 0
            while blen - pos >= 4:
                end = pos + 4 + u32_from(buf, pos)[0]
                if end > blen:
                    break
                cmd = buf[pos + OFF_CMD]
                if cmd == C_PUSH:
                    mid = i64_from(buf, pos + OFF_MESSAGE_ID)[0]
                    ids.append(mid)
                    if mid in seen:
                        duplicates += 1
                    else:
                        seen.add(mid)
                        fresh += 1
                        if record_priority:
                            status_at, p = push_status_span(buf, pos)
                            order_ids.append(mid)
                            order_priorities.append(status_priority(buf[status_at:p]) if p > status_at else 0)
                        if want_latency or hot_status is not None:
                            status_at, p = push_status_span(buf, pos)  # p: the body
                            if hot_status is not None and buf[status_at:p] == hot_status:
                                read_hot += 1
                            if want_latency and end - p >= 8:
                                lat.append((now_ns - i64_from(buf, p)[0]) / 1e9)
                                if lat_tags is not None:
                                    lat_tags.append(buf[p + 8] if end - p > 8 else 0)
                elif cmd == C_PROTOCOL_ERROR:
                    raise ConnectionError(_status_of(buf, pos, end))
                pos = end
            if pos:
                del buf[:pos]
            if fresh:
                if hot_status is not None:
                    hot += read_hot
                    cold += fresh - read_hot
                    reads.extend((time.time(), fresh - read_hot, read_hot))
                    fresh -= read_hot
                counted += fresh
                if record_priority:
                    order_times.extend((time.time(), len(order_ids)))
                if shared is not None and fresh:
                    with shared.get_lock():
                        shared.value += fresh
            if ids:
                if not t_first:
                    t_first = time.time()
                    t_first_push = t_first_push or t_first
                received += len(ids)
                phase_received += len(ids)
                if do_ack:
                    sock.sendall(acks.frames(ids))
                    acked += len(ids)
                    phase_acked += len(ids)
                    t_last = time.time()
                else:
                    held.extend(ids)
        phase_log.append(
            {
                "ack": do_ack,
                "t_start": phase_start,
                "t_end": time.time(),
                "received": phase_received,
                "acked": phase_acked,
            }
        )
    sock.close()
    result.update(
        received=received,
        unique=len(seen),
        duplicates=duplicates,
        acked=acked,
        t_start=t_start,
        t_first=t_first,
        t_last=t_last,
        phases=phase_log,
        lat=lat.tobytes(),
        lat_tags=lat_tags.tobytes() if lat_tags is not None else b"",
        hot=hot,
        cold=cold,
        reads=reads.tobytes(),
        timed_out=timed_out,
        t_subscribe=t_subscribe,
        t_first_push=t_first_push,
        order_ids=order_ids.tobytes(),
        order_priorities=order_priorities.tobytes(),
        order_times=order_times.tobytes(),
    )

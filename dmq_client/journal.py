"""The producer journal: a send queue on disk, so a producer crash loses no accepted message.

DMQ admits (seeds/003, 2.4 and 六) that its producer keeps accepted messages in
memory only, so a crash of the producer process loses them. With
``MqConfig.journal_path`` set, ``MqClient`` uses ``JournalSendQueue`` instead of
the in-memory queue: ``send()`` writes the message to the journal before it
answers (and, with ``sync_every=1``, fsyncs it), and the message leaves the
journal only once its result has been delivered to its callback. A client that
opens the journal again after a crash sends what is left, as
``UP_PRODUCER_RESEND`` with the original producer id and session id, so the
server's resend idempotency turns a message that was stored before the crash
into a ``duplicate`` answer instead of a second copy.

On disk, in the journal directory::

    lock                          flock()ed while a client has the journal open
    journal-<G>.diskqueue.*       generation G of the record queue (dmq_client.diskqueue files)
    done.log                      8-byte sequence numbers of records finished out of order

Records. Each accepted message is one disk-queue record, numbered with a
journal sequence number ``seq``::

    crc32 (I) | version (B) | flags (B) | msg_type (B) | seq (Q) | session_id (q)
    | timestamp_ms (q) | due_ms (q) | len(topic) (H) | len(producer) (H) | topic | producer | body

A message with properties (a key, a priority, headers) is a version 2 record: after the
producer come ``len(status) (H) | status`` (the properties as the wire carries them,
``dmq_client.wire.properties``), then the body. Records without properties stay version
1, so a journal written without them is still read by a client that predates them, and
one with them is refused by such a client (unknown version) rather than sent without.

The producer id and session id are assigned before the record is written and
kept in it, so a replay is the same ``(producer, session_id)`` pair as the first
attempt, whichever id the client that replays it has. That client sends its new
messages under an id of its own: a new one for every open (``default_producer_id``)
unless one is configured, so no message of one producer instance can be taken
for a resend of another's, not even with the wall clock set back across a
restart (session ids come from the clock).

What is finished. Results come back out of order (topics go to different
servers, resends). The disk queue's read position is the *watermark*: every
record before it is finished. When the record at the head finishes, it is read
off the queue, with every following record that had already finished. A
record that finishes while an older one is still pending is added to
``done.log`` instead. Both are made durable by the ticker's next sync (every
``sync_interval``) or at shutdown. A restart skips
records before the watermark and those in ``done.log``. A finish that was not
synced yet when the process died is replayed: delivery is at least once, and
the server's idempotency absorbs the replay (within its retention window).

Which results remove a record. Only a *final* result (``message.FINAL``):
SUCCESS (stored), NO_TOPIC or INVALID_MESSAGE (refused for something the same
message would be refused for again: the application's to handle). A message
that was not stored stays journaled until it is, or until the application gives
it up: the producer does not even report the *transient* failures
(``message.TRANSIENT``: SOCKET_ERROR, SERVER_ERROR, RATE_LIMIT_EXCEEDED,
OUT_OF_RETRY) of a journaled send but retries it with backoff (``hold`` and
``requeue``; see ``dmq_client.producer``), unless ``journal_give_up_after`` runs
out, which marks the send ``given_up``: that failure is delivered and removes
the record. Any other result (CLIENT_CLOSED: the client closed before the
message was stored) keeps the record, and the next open sends it again.

Duplicates. A message is identified by ``(producer, session_id)``, not by its
record: ``client.resend`` of a journaled message writes a second record with the
same pair. Recovery keeps the first unfinished record of each pair and drops
later copies (the server would store only one of them and answer the others as
duplicates), so a message replayed next to its own resend copy is sent once.

Opening. Disk-queue reads are destructive, so the journal cannot look at its
records without removing them. Opening therefore *compacts*: it reads every
older generation record by record, copies each record that is neither finished
nor already copied into a new generation, fsyncs the new generation, and only
then removes the old ones and empties ``done.log``. Each record is copied
before it is read off the old generation, and the new generation is fsynced
before a read can delete an old data file, so a crash at any point, even a
power cut, leaves every unfinished record in at least one generation; the next
open merges them by ``seq``.

Sync policy. ``sync_every=1`` (the default): ``put`` returns only after the
data file holding the record is fdatasync'ed. That is done outside the disk
queue's lock, so concurrent senders keep appending meanwhile and share the next
fdatasync (group commit). The disk queue's metadata (its read and write
positions) and ``done.log`` are synced by a ticker thread every
``sync_interval`` seconds (and at rotation and shutdown): after a crash the disk
queue reads a write file up to its real size, past a stale recorded end, so a
record whose data was synced is found even if the metadata was not.
``sync_every=N``: only every N-th put waits for an fdatasync and the ticker
syncs the rest; a crash of the machine (not just the process: the page cache
survives that) can lose the messages accepted since the last sync.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import struct
import threading
import zlib
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .diskqueue import DiskQueue, DiskQueueError
from .message import FINAL, Message, SendResult, Status
from .notify import call_callback
from .pending import PendingSend, SendCallback
from .send_queue import MemorySendQueue, Put
from .session import default_producer_id
from .wire import NO_PROPERTIES, MessageType, decode_properties

if TYPE_CHECKING:
    from .config import MqConfig

__all__ = ["KEPT", "JournalError", "JournalRecord", "JournalSendQueue", "decode_record", "encode_record"]

log = logging.getLogger(__name__)

VERSION = 1
VERSION_PROPERTIES = 2  # a record whose message has properties
_HEAD = struct.Struct(">IBBBQqqqHH")
_STATUS_LEN = struct.Struct(">H")
_SEQ = struct.Struct(">Q")
_SEQ_OFFSET = 7  # crc (4) + version, flags, msg_type (3)
_FLAG_RESEND = 1
#: data files of a generation rotate at this size; a file is deleted once every record in it finished
FILE_BYTES = 16 * 1024 * 1024
_QUEUE_RE = re.compile(r"^journal-(\d+)\.diskqueue\.(?:meta|\d+)\.dat$")
_NEVER = 2**31 - 1  # the disk queue's own sync triggers: never (the journal syncs explicitly)
#: added to a CLIENT_CLOSED result's description when the journal keeps the message
KEPT = " (kept in the producer journal: sent again when it is next opened)"


class JournalError(Exception):
    """The journal cannot be opened (in use by another client, unusable directory)."""


@dataclass(frozen=True, slots=True)
class JournalRecord:
    """One accepted message as the journal keeps it: everything needed to send it again."""

    seq: int
    session_id: int
    producer: str
    topic: str
    body: bytes
    msg_type: int = MessageType.RELIABLE
    due_ms: int = 0
    timestamp_ms: int = 0
    resend: bool = False
    status: str = ""  # the message's properties as the wire carries them ('' for none)


def encode_record(seq: int, item: PendingSend) -> bytes:
    m = item.message
    topic = m.topic.encode("utf-8")
    producer = item.producer.encode("utf-8")
    status = m.status().encode("utf-8")
    rest = _HEAD.pack(
        0, VERSION_PROPERTIES if status else VERSION, _FLAG_RESEND if item.resend else 0, int(m.msg_type), seq,
        item.session_id, item.timestamp_ms, m.due_ms, len(topic), len(producer),
    )[4:]
    if status:
        rest = b"".join((rest, topic, producer, _STATUS_LEN.pack(len(status)), status, m.body))
    else:
        rest = b"".join((rest, topic, producer, m.body))
    return struct.pack(">I", zlib.crc32(rest)) + rest


def decode_record(data: bytes) -> JournalRecord:
    """The record in ``data``; ``ValueError`` if it is damaged or of an unknown version."""
    if len(data) < _HEAD.size:
        raise ValueError(f"record of {len(data)} bytes is shorter than its header")
    crc, version, flags, msg_type, seq, sid, ts, due, tlen, plen = _HEAD.unpack_from(data)
    if zlib.crc32(memoryview(data)[4:]) != crc:
        raise ValueError("record checksum mismatch")
    if version != VERSION and version != VERSION_PROPERTIES:
        raise ValueError(f"unknown record version {version}")
    end = _HEAD.size + tlen + plen
    if end > len(data):
        raise ValueError("record lengths exceed the record")
    topic = data[_HEAD.size : _HEAD.size + tlen].decode("utf-8")
    producer = data[_HEAD.size + tlen : end].decode("utf-8")
    status = ""
    if version == VERSION_PROPERTIES:
        if end + _STATUS_LEN.size > len(data):
            raise ValueError("record lengths exceed the record")
        (slen,) = _STATUS_LEN.unpack_from(data, end)
        start, end = end + _STATUS_LEN.size, end + _STATUS_LEN.size + slen
        if end > len(data):
            raise ValueError("record lengths exceed the record")
        status = data[start:end].decode("utf-8")
    return JournalRecord(seq, sid, producer, topic, data[end:], msg_type, due, ts, bool(flags & _FLAG_RESEND),
                         status)


class _RecoveredCallback:
    """The callback of a message recovered at open: its own callback died with the old
    process. Logs the result (failures as warnings), then calls ``recovered_callback``."""

    __slots__ = ("user", "path")

    def __init__(self, user: SendCallback | None, path: str):
        self.user = user
        self.path = path

    def on_result(self, result: SendResult) -> None:
        if result.status is Status.SUCCESS:
            log.debug("journal %s: recovered message %d stored as %s%s", self.path, result.session_id,
                      result.message_id, " (duplicate)" if result.duplicate else "")
        elif result.status is not Status.CLIENT_CLOSED:
            log.warning("journal %s: recovered message %d to %r: %s %s", self.path, result.session_id,
                        result.message.topic, result.status.value, result.description)
        if self.user is not None:
            call_callback(self.user, result)


class JournalSendQueue(MemorySendQueue):
    """A ``SendQueue`` whose items are journaled on disk until their result is delivered.

    ``capacity`` bounds the items waiting for the send runner, as in
    ``MemorySendQueue``; items recovered at open are all accepted even beyond it.
    ``producer_id``: the id for new sends; empty means a new one for this open
    (recovered records keep the id they were first sent with). ``recovered_callback`` gets the results of
    recovered items. ``ticker=False`` leaves time-driven syncs to ``sync_pending``
    (tests). Raises ``JournalError`` if another client has the journal open.

    Thread-safe. Call ``shutdown`` (the client does, for a journal it opened from
    ``MqConfig.journal_path``) to sync and close the files.
    """

    keeps_unfinished = True
    """CLIENT_CLOSED results leave the message journaled (the producer says so in the result)."""
    retries_unfinished = True
    """The producer retries transient failures of journaled sends (``hold``, ``requeue``)."""
    compact_after = 65536
    """done.log is rewritten when it holds more entries than this and 4x the unread finished ones."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity: int = 10000,
        sync_every: int = 1,
        sync_interval: float = 1.0,
        producer_id: str = "",
        recovered_callback: SendCallback | None = None,
        max_body_size: int = 65536,
        file_bytes: int = FILE_BYTES,
        ticker: bool = True,
    ):
        super().__init__(capacity)  # the queue itself: a deque under self._cond
        if sync_every < 1 or not sync_interval > 0:
            raise ValueError("sync_every must be >= 1 and sync_interval > 0")
        self.path = os.path.abspath(os.fspath(path))
        self.sync_every = sync_every
        self.sync_interval = sync_interval
        self._file_bytes = file_bytes
        # large enough for any record a client could have written; the bound only
        # catches a corrupt length field
        self._max_record = max(64 * 1024 * 1024, max_body_size + 64 * 1024)
        self._sync_lock = threading.Lock()
        self._order: deque[int] = deque()  # seqs of the live generation's unread records, in order
        self._seq_of: dict[PendingSend, int] = {}  # journaled items not finished yet
        self._done: set[int] = set()  # finished, but an older record is not: not yet read off
        self._held = 0  # journaled items the producer holds for a retry: they count against capacity
        self._marks: list[int] = []  # finishes to append to done.log at the next sync
        self._written = self._synced = 0  # puts so far / puts whose data file was synced
        self._next_seq = 0  # the next record's sequence number (set again by the recovery)
        self._full_synced = 0  # puts covered by a full sync (positions too)
        self._data_fd: int | None = None  # the write file, opened to fdatasync it
        self._data_fd_file = -1
        self._reads_unsynced = 0
        self._donelog_entries = 0
        self._dir_synced_file = -1
        self._shut = False  # files closed
        self.syncs = 0
        self.bad_records = 0
        self.duplicates = 0  # records dropped at open as copies of the same (producer, session id)
        self.last_error = ""
        os.makedirs(self.path, exist_ok=True)
        self._lock_fd = _lock(os.path.join(self.path, "lock"))
        try:
            self.producer_id = producer_id or default_producer_id()
            self._done_path = os.path.join(self.path, "done.log")
            records = self._recover()
            self._done_fd = os.open(self._done_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except (OSError, DiskQueueError) as exc:
            os.close(self._lock_fd)
            raise JournalError(f"journal {self.path!r} cannot be opened: {exc}") from exc
        except BaseException:
            os.close(self._lock_fd)
            raise
        callback = _RecoveredCallback(recovered_callback, self.path)
        for rec in records:
            props = decode_properties(rec.status) if rec.status else NO_PROPERTIES
            message = Message(rec.topic, rec.body, session_id=rec.session_id,
                              msg_type=MessageType(rec.msg_type), due_ms=rec.due_ms, key=props.key,
                              priority=props.priority, headers=dict(props.headers) or None)
            item = PendingSend(message, rec.session_id, rec.producer, rec.timestamp_ms, callback, resend=True)
            self._items.append(item)
            self._order.append(rec.seq)
            self._seq_of[item] = rec.seq
        self.recovered = len(records)
        if records:
            log.info("journal %s: recovered %d unfinished messages; sending them again", self.path, len(records))
        if self.duplicates:
            log.info("journal %s: %d recovered records were resend copies of another; each message is sent once",
                     self.path, self.duplicates)
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if ticker:
            self._ticker = threading.Thread(target=self._tick_loop, name="dmq-journal", daemon=True)
            self._ticker.start()

    @classmethod
    def from_config(cls, config: MqConfig) -> "JournalSendQueue":
        """The journal ``MqConfig`` describes (``journal_path`` must be set: ValueError if not)."""
        if config.journal_path is None:
            raise ValueError("MqConfig.journal_path is not set: there is no journal to open")
        return cls(
            config.journal_path,
            capacity=config.send_queue_size,
            sync_every=config.journal_sync_every,
            sync_interval=config.journal_sync_interval,
            producer_id=config.producer_id,
            recovered_callback=config.recovered_callback,
            max_body_size=config.max_body_size,
        )

    # -- the SendQueue protocol (get_batch, close, drain, len: MemorySendQueue's) ------------
    def put(self, item: PendingSend) -> Put:
        put, ticket = self._append(item, queued=True)
        if put is Put.ACCEPTED and ticket - self._synced >= self.sync_every:
            self._sync_upto(ticket)
        return put

    def keep(self, items: list[PendingSend]) -> list[Put]:
        """Journal ``items`` as ``put`` would, but without queueing them: for a client that
        writes its sends itself (the asyncio client, from a worker thread: see
        ``dmq_client.aio.journal``). They are made as durable as ``sync_every`` asks by one
        sync for all of them (group commit within the batch), and forgotten by ``task_done``
        as put items are. Returns each item's ``Put``."""
        answers = []
        last = 0
        for item in items:
            put, ticket = self._append(item, queued=False)
            answers.append(put)
            if put is Put.ACCEPTED:
                last = ticket
        if last and last - self._synced >= self.sync_every:
            self._sync_upto(last)
        return answers

    def _append(self, item: PendingSend, queued: bool) -> tuple[Put, int]:
        """Write ``item``'s record (not synced yet); with ``queued`` also queue it for the
        send runner. Returns the answer and the put's ticket for ``_sync_upto``."""
        with self._cond:
            if self._closed:
                return Put.CLOSED, 0
            if len(self._items) + self._held >= self.capacity:
                return Put.FULL, 0
            seq = self._next_seq
            try:
                self._dq.put(encode_record(seq, item))
            except (DiskQueueError, UnicodeError, struct.error) as exc:
                self.last_error = f"E_JOURNAL the producer journal could not store the message: {exc}"
                log.error("journal %s: put failed: %s", self.path, exc)
                return Put.FAILED, 0
            self._next_seq = seq + 1
            self._written += 1
            self._order.append(seq)
            self._seq_of[item] = seq
            if queued:
                self._items.append(item)
                if len(self._items) == 1:
                    self._cond.notify()
            return Put.ACCEPTED, self._written

    def task_done(self, item: PendingSend) -> None:
        result = item.result
        if result is None or (result.status not in FINAL and not item.given_up):
            return  # not stored and not given up: kept, sent again when the journal is opened next
        with self._cond:
            seq = self._seq_of.pop(item, None)
            if seq is None or self._shut:
                return  # refused by put, never journaled (or the files are closed: replayed)
            order = self._order
            if not order or order[0] != seq:
                self._done.add(seq)
                self._marks.append(seq)
                return
            order.popleft()
            self._read_off(seq)
            while order and order[0] in self._done:
                head = order.popleft()
                self._done.discard(head)
                self._read_off(head)

    # -- retries (the producer's retry pen) ----------------------------------------------------
    def hold(self, item: PendingSend) -> bool:
        """The producer keeps ``item`` aside to retry it later. True if it is journaled and
        unfinished (then it counts against ``capacity`` until ``requeue`` or ``unhold``);
        False for an item this queue never journaled (it gets its failure instead)."""
        with self._cond:
            if item not in self._seq_of or self._shut:
                return False
            self._held += 1
            return True

    def requeue(self, items: list[PendingSend]) -> None:
        """Held items whose retry is due: back to the queue (in memory; they are journaled
        already), ahead of new sends, also after ``close`` (``drain`` collects them then)."""
        with self._cond:
            self._held -= len(items)
            self._items.extendleft(reversed(items))
            self._cond.notify()

    def unhold(self, n: int) -> None:
        """``n`` held items were given their result instead (the client closed)."""
        with self._cond:
            self._held -= n

    # -- journal state ------------------------------------------------------------------------
    @property
    def journaled(self) -> int:
        """Records not finished: queued, in flight, or waiting for their result's delivery."""
        return len(self._order) - len(self._done)

    def sync(self) -> None:
        """Make every put and finish so far durable now."""
        with self._cond:
            ticket = self._written
        self._sync_upto(ticket, full=True)

    def sync_pending(self) -> None:
        """Sync if anything is not durable yet (the ticker calls this every ``sync_interval``)."""
        with self._cond:
            dirty = self._written > self._full_synced or self._marks or self._reads_unsynced
            ticket = self._written
        if dirty:
            self._sync_upto(ticket, full=True)

    def shutdown(self) -> None:
        """Refuse puts, sync, close the files and release the journal. Idempotent.
        Unfinished records stay and are recovered by the next open."""
        self.close()
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join(10)
        with self._sync_lock:
            with self._cond:
                if self._shut:
                    return
            try:
                self._sync_all_locked()
            except (OSError, DiskQueueError) as exc:
                log.error("journal %s: final sync failed: %s", self.path, exc)
            with self._cond:
                self._shut = True
                try:
                    self._dq.close()
                except DiskQueueError as exc:
                    log.error("journal %s: close failed: %s", self.path, exc)
                self._close_fds()

    def abandon(self) -> None:
        """Close the files without syncing anything, as a killed process would leave
        them (tests use it to simulate a crash in-process)."""
        self.close()
        self._stop.set()
        with self._cond:
            if self._shut:
                return
            self._shut = True
            self._dq.delete()
            self._close_fds()

    def _close_fds(self) -> None:
        if self._data_fd is not None:
            os.close(self._data_fd)
            self._data_fd = None
        os.close(self._done_fd)
        os.close(self._lock_fd)  # releases the flock

    def __enter__(self) -> "JournalSendQueue":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"<JournalSendQueue {self.path!r} queued={len(self._items)} journaled={self.journaled}>"

    # -- internals ----------------------------------------------------------------------------
    def _read_off(self, seq: int) -> None:
        """Take the head record (``seq``) off the disk queue: the watermark moves past it."""
        try:
            data = self._dq.read()
        except DiskQueueError as exc:
            log.error("journal %s: reading off record %d failed: %s", self.path, seq, exc)
            return
        self._reads_unsynced += 1
        if data is None or len(data) < _SEQ_OFFSET + 8 or _SEQ.unpack_from(data, _SEQ_OFFSET)[0] != seq:
            # only a damaged data file (renamed .bad by the disk queue) can cause this
            log.error("journal %s: expected record %d at the head, found %s", self.path, seq,
                      "nothing" if data is None else "another record")

    def _tick_loop(self) -> None:
        while not self._stop.wait(self.sync_interval):
            try:
                self.sync_pending()
            except Exception:
                log.exception("journal %s: periodic sync failed", self.path)

    def _sync_upto(self, ticket: int, full: bool = False) -> None:
        """Make puts up to ``ticket`` durable (``full``: everything, also the positions and
        the finishes). Threads arriving while a sync runs share the next one."""
        with self._sync_lock:
            if self._shut or (self._synced >= ticket and not full):
                return
            try:
                if full:
                    self._sync_all_locked()
                else:
                    self._sync_data_locked()
            except (OSError, DiskQueueError) as exc:
                log.error("journal %s: sync failed: %s", self.path, exc)

    def _sync_data_locked(self) -> None:
        """The put path: fdatasync the data file the records went to, outside the disk
        queue's lock, so concurrent puts keep appending and share the next sync. Earlier
        data files were fsynced by the disk queue when it rotated. The metadata (read and
        write positions) follows at the next full sync; after a crash before that the disk
        queue reads the write file up to its real size, so no synced record is missed."""
        with self._cond:
            if self._shut:
                return
            target = self._written
            write_file = self._dq.write_file_num
        fd = self._data_fd
        if fd is None or self._data_fd_file != write_file:
            if fd is not None:
                os.close(fd)
                self._data_fd = None
            fd = self._data_fd = os.open(self._dq.file_name(write_file), os.O_RDONLY)
            self._data_fd_file = write_file
        os.fdatasync(fd)
        self._sync_dir(write_file)
        self._synced = max(self._synced, target)
        self.syncs += 1

    def _sync_all_locked(self) -> None:
        """A full sync (holding ``_sync_lock``): data file and metadata, done marks, directory."""
        with self._cond:
            if self._shut:
                return
            target = self._written
            marks, self._marks = self._marks, []
            self._reads_unsynced = 0
            compact = None
            if self._donelog_entries + len(marks) > max(self.compact_after, 4 * len(self._done)):
                compact = sorted(self._done)  # taken before the disk queue sync: see _compact_done_log
        self._dq.sync()
        if compact is not None:
            self._compact_done_log(compact)
        elif marks:
            _write_all(self._done_fd, b"".join(_SEQ.pack(s) for s in marks))
            os.fsync(self._done_fd)
            self._donelog_entries += len(marks)
        self._sync_dir(self._dq.write_file_num)
        self._synced = max(self._synced, target)
        self._full_synced = max(self._full_synced, target)
        self.syncs += 1

    def _sync_dir(self, write_file: int) -> None:
        if write_file != self._dir_synced_file:  # a new data file: make its name durable too
            _fsync_dir(self.path)
            self._dir_synced_file = write_file

    def _compact_done_log(self, live: list[int]) -> None:
        """Rewrite done.log with ``live``, the unread finished seqs taken before the last
        disk-queue sync: any seq missing from it was read off before that sync, which made
        its read durable, so its entry is no longer needed."""
        tmp = self._done_path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, b"".join(_SEQ.pack(s) for s in live))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self._done_path)
        _fsync_dir(self.path)
        new_fd = os.open(self._done_path, os.O_WRONLY | os.O_APPEND)
        with self._cond:
            old, self._done_fd = self._done_fd, new_fd
        os.close(old)
        self._donelog_entries = len(live)

    def _open_queue(self, generation: int) -> DiskQueue:
        return DiskQueue(
            f"journal-{generation}", self.path,
            max_bytes_per_file=self._file_bytes, min_msg_size=_HEAD.size, max_msg_size=self._max_record,
            sync_every=_NEVER, sync_timeout=float(_NEVER), logger=log,
        )

    def _recover(self) -> list[JournalRecord]:
        """Compact every existing generation into a new one; return its records in order."""
        done = _read_done_log(self._done_path)
        generations = sorted({int(m.group(1)) for m in map(_QUEUE_RE.match, os.listdir(self.path)) if m})
        generation = generations[-1] + 1 if generations else 0
        new = self._open_queue(generation)
        max_seq = max(done, default=-1)
        records: list[JournalRecord] = []
        copied: set[int] = set()
        keys: set[tuple[str, int]] = set()  # (producer, session id) of the records copied
        old_queues = []
        try:
            for old_generation in generations:
                old = self._open_queue(old_generation)
                old_queues.append(old)
                while (data := old.peek()) is not None:
                    try:
                        rec = decode_record(data)
                    except (ValueError, UnicodeError) as exc:
                        self.bad_records += 1
                        log.error("journal %s: skipping a damaged record in generation %d: %s",
                                  self.path, old_generation, exc)
                    else:
                        max_seq = max(max_seq, rec.seq)
                        if rec.seq not in done and rec.seq not in copied:
                            copied.add(rec.seq)
                            if (rec.producer, rec.session_id) in keys:
                                # a resend copy of a message copied already: the same message
                                self.duplicates += 1
                            else:
                                new.put(data)  # copied before it is read off the old generation
                                keys.add((rec.producer, rec.session_id))
                                records.append(rec)
                    if _read_leaves_file(old, data):
                        new.sync()  # that read deletes an old data file: the copies go first
                    old.read()
            new.sync()
            _fsync_dir(self.path)
            for old_generation, old in zip(generations, old_queues):
                old.destroy()
                _remove_leftovers(self.path, old_generation)
            _fsync_dir(self.path)
            fd = os.open(self._done_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            for q in old_queues:
                q.delete()
            new.delete()
            raise
        self._dq = new
        self._next_seq = max_seq + 1
        self._dir_synced_file = new.write_file_num
        return records


def _lock(file_name: str) -> int:
    fd = os.open(file_name, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise JournalError(f"journal {os.path.dirname(file_name)!r} is in use by another client") from None
        raise
    return fd


def _read_done_log(file_name: str) -> set[int]:
    try:
        with open(file_name, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return set()
    whole = len(raw) // 8 * 8  # a torn last entry (crash mid-write) is ignored
    return {s for (s,) in _SEQ.iter_unpack(raw[:whole])}


def _read_leaves_file(queue: DiskQueue, data: bytes) -> bool:
    """Whether reading ``data`` (the peeked head) moves ``queue``'s reader to its next
    data file, which deletes the current one."""
    if queue.read_file_num >= queue.write_file_num:
        return False
    try:
        size = os.path.getsize(queue.file_name(queue.read_file_num))
    except OSError:
        return True
    return queue.read_pos + 4 + len(data) >= size


def _remove_leftovers(path: str, generation: int) -> None:
    """Files of a destroyed generation that the disk queue did not know about (from a
    crash during an earlier destroy, or metadata tmp files); ``.bad`` files are kept."""
    prefix = f"journal-{generation}.diskqueue."
    for name in os.listdir(path):
        if name.startswith(prefix) and not name.endswith(".bad"):
            try:
                os.remove(os.path.join(path, name))
            except OSError as exc:
                log.warning("journal %s: could not remove %s: %s", path, name, exc)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

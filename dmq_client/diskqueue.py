"""A file-backed FIFO of byte strings whose files are byte-compatible with go-diskqueue.

nsqd spills topic and channel queues to disk with go-diskqueue (github.com/nsqio/go-diskqueue).
This module writes and reads the same files, so a dmq data directory and an nsqd one
can be swapped. The server's NSQ store overflows its memory queues here, and the client's
producer journal keeps its send queue here. Pure Python: no Twisted, no thread of its own.

On disk, in ``data_path``::

    <name>.diskqueue.000000.dat     <name>.diskqueue.000001.dat  ...  (``%06d``, grows past 6 digits)
    +----------+---------+----------+---------+--     a data file is only records, no header,
    | int32 BE | payload | int32 BE | payload | ..    no CRC and no index; a record is written
    |  = len   | len B   |  = len   | len B   |       by one write() (with others: write_buffer)
    +----------+---------+----------+---------+--
    <name>.diskqueue.meta.dat       text "%d\\n%d,%d\\n%d,%d\\n":
                                    depth \\n readFileNum,readPos \\n writeFileNum,writePos \\n
    <name>.diskqueue.NNNNNN.dat.bad a data file the reader could not parse, kept for forensics

Why each rule exists (function names are go-diskqueue's):

* Rotate *before* a write: when ``writePos > 0`` and ``writePos + 4 + len > maxBytesPerFile``
  the writer moves to the next file first (``writeOne``). Files therefore never exceed
  maxBytesPerFile, except a file holding one record larger than the limit.
* A finished file (``readFileNum < writeFileNum``) is read up to its real size (``readOne``
  stats it), never up to maxBytesPerFile, so reopening with another max size works. The
  limit is not stored anywhere.
* One deliberate difference: when the reader has read the whole write file and the writer
  then rotates, go-diskqueue cc41549 reads past the end, gets EOF and renames the finished
  good file to ``.bad`` (its issues #38 and #42). Here the reader moves on to the next file
  and deletes the old one as usual. No record is read differently.
* A data file is deleted as soon as the reader moves past it (``moveForward``); only the files
  from readFileNum to writeFileNum exist.
* A record whose length is outside [min_msg_size, max_msg_size], or that is cut short, means
  the file is corrupt and no later record can be found in it. The reader renames it to ``.bad``
  and goes on with the next file. If that file was the write file, the writer moves on as well
  (``handleReadError``). Skipped records are not subtracted from depth. Depth is fixed when the
  reader reaches the writer: a nonzero depth there is logged and set to 0. A reader found past
  the writer (readPos > writePos) drops the current files and both move to a new file
  (``checkTailCorruption``, ``skipToNextRWFile``).
* The metadata is a snapshot taken at each sync. It is written to ``<meta>.<random>.tmp``,
  fsynced and renamed over the old one (``persistMetaData``), so a crash leaves either the old
  snapshot or the new one. A sync also fsyncs the write file first (``sync``). Syncs happen
  every ``sync_every`` puts+reads, at the first ``sync_timeout`` tick after any activity, when
  the writer rotates, when the reader changes file or skips a bad one, and on close.
* After a crash the snapshot is stale. If the write file is longer than the saved writePos,
  the writer starts a new file, and the reader re-reads from the saved readPos. Records read
  since the last sync are delivered again, and records written since then are kept, never
  overwritten (``retrieveMetaData``). Depth can then go negative until the reader reaches
  the tail.

In Go an ioLoop goroutine owns the state and reads one record ahead. Here every public method
takes a lock and does the work that loop would have done before the call's own event: any
pending sync, then the one-record read-ahead, which may find and rename a bad file. After the
event it does the sync the event requires. The Go loop runs this same sequence (event, sync,
read-ahead, next event), so the files change in the same order. With no goroutine, work that
waits for time happens only when a method is called: call :meth:`DiskQueue.tick` periodically
(a LoopingCall) so an idle queue still syncs within ``sync_timeout``.

With ``write_buffer`` (bytes, default 0: off) ``put`` keeps records in memory and writes
them together, with one write(), when that many are waiting, on ``flush``, and before
anything reads the write file, syncs, rotates or closes; ``on_buffered`` is told when a
record starts a new wait, so an owner can flush once per batch (the server's NSQ store: once
per reactor turn). The files are the same byte for byte; only the moment of the write moves.

Other differences, none visible in the files: close() fsyncs the write file before writing
the metadata (Go closes it unsynced), and calling it twice is harmless. A missing data_path
fails at construction. A metadata file that cannot be parsed starts the queue from zero.
"""

from __future__ import annotations

import logging
import os
import random
import re
import struct
import threading
import time
from collections.abc import Callable
from types import TracebackType

__all__ = ["DEFAULT_MAX_MSG_SIZE", "DiskQueue", "DiskQueueError"]

#: nsqd's default --max-msg-size (1 MiB) plus the 26-byte message header, which nsqd stores in
#: each record; this is the maxMsgSize nsqd passes to go-diskqueue.
DEFAULT_MAX_MSG_SIZE = 1024 * 1024 + 26

_SIZE = struct.Struct(">i")
_INT32_MAX = 2**31 - 1
_READ_CHUNK = 64 * 1024
# go-diskqueue reads it with fmt.Fscanf("%d\n%d,%d\n%d,%d\n"); accept the same, a bit leniently.
_META_RE = re.compile(
    rb"[ \t]*([+-]?\d+)[ \t]*\n[ \t]*([+-]?\d+),[ \t]*([+-]?\d+)[ \t]*\n"
    rb"[ \t]*([+-]?\d+),[ \t]*([+-]?\d+)[ \t]*(?:\n|$)"
)


class DiskQueueError(Exception):
    """A put, read or file operation failed, or the queue is closed ("exiting")."""


class _BadRecord(Exception):
    """The read file holds no valid record at the read position."""


class DiskQueue:
    """A FIFO of byte strings in go-diskqueue's files. Thread-safe. Open it with ``with``,
    or call :meth:`close`."""

    def __init__(
        self,
        name: str,
        data_path: str | os.PathLike[str],
        *,
        max_bytes_per_file: int = 100 * 1024 * 1024,
        min_msg_size: int = 0,
        max_msg_size: int = DEFAULT_MAX_MSG_SIZE,
        sync_every: int = 2500,
        sync_timeout: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger | None = None,
        write_buffer: int = 0,
        on_buffered: Callable[[DiskQueue], None] | None = None,
    ):
        if max_bytes_per_file < 1:
            raise ValueError("max_bytes_per_file must be >= 1")
        if not 0 <= min_msg_size <= max_msg_size <= _INT32_MAX:
            raise ValueError("need 0 <= min_msg_size <= max_msg_size <= 2**31-1")
        if sync_every < 1 or not sync_timeout > 0:
            raise ValueError("sync_every must be >= 1 and sync_timeout > 0")
        if write_buffer < 0:
            raise ValueError("write_buffer must be >= 0")
        self.name = name
        self.data_path = os.fspath(data_path)
        if not os.path.isdir(self.data_path):
            raise DiskQueueError(f"data path {self.data_path!r} is not a directory")
        self.max_bytes_per_file = max_bytes_per_file
        self.min_msg_size = min_msg_size
        self.max_msg_size = max_msg_size
        self.sync_every = sync_every
        self.sync_timeout = sync_timeout
        self._clock = clock
        self._log = logger or logging.getLogger(__name__)
        self._lock = threading.Lock()
        # The state go-diskqueue persists, plus the read-ahead position (nextRead*).
        self._depth = self._read_file_num = self._read_pos = 0
        self._write_file_num = self._write_pos = 0
        self._next_read_file_num = self._next_read_pos = 0
        self._max_bytes_per_file_read = 0
        self._pending: bytes | None = None  # the record read ahead, not yet handed out
        self._need_sync = False
        self._count = 0  # puts + reads since the last sync
        self._closed = False
        self._read_fd: int | None = None
        self._rbuf = b""
        self._rbuf_off = 0
        self._write_fd: int | None = None
        # Records put but not yet written (write_buffer > 0): already counted in writePos
        # and depth, written by flush() or before anything reads or syncs the write file.
        self._write_buffer = write_buffer
        self._on_buffered = on_buffered
        self._wbuf: list[bytes] = []
        self._wbuf_bytes = 0
        self._retrieve_metadata()
        self._next_tick = clock() + sync_timeout

    # -- public API -----------------------------------------------------------------------
    @property
    def read_file_num(self) -> int:
        """File the reader is in."""
        return self._read_file_num

    @property
    def read_pos(self) -> int:
        """Offset of the next unread record."""
        return self._read_pos

    @property
    def write_file_num(self) -> int:
        """File the writer is in."""
        return self._write_file_num

    @property
    def write_pos(self) -> int:
        """Offset the next record goes to."""
        return self._write_pos

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran."""
        return self._closed

    def put(self, data: bytes) -> None:
        """Append one record. Raises DiskQueueError on a bad size, a closed queue or an IO error."""
        payload = data if isinstance(data, bytes) else bytes(data)
        with self._lock:
            self._check_open()
            self._begin()
            self._count += 1
            try:
                self._write_one(payload)
            finally:
                self._sync_if_needed()

    def put_many(self, records: list[bytes]) -> None:
        """Append records in order, as ``put`` one after another would, under one lock and
        one look at the clock: a queue taking a batch (a topic's backlog moved to a
        channel) pays the per-call bookkeeping once. If one fails, those before it are
        stored and DiskQueueError says why."""
        with self._lock:
            self._check_open()
            self._begin()
            i, n = 0, len(records)
            while i < n:
                self._loop_top()  # what the next put's _begin would do, the clock aside
                if self._write_buffer and self._pending is not None:
                    taken = self._buffer_many(records, i)
                    if taken:
                        i += taken
                        continue
                data = records[i]
                i += 1
                self._count += 1
                try:
                    self._write_one(data if isinstance(data, bytes) else bytes(data))
                finally:
                    self._sync_if_needed()

    def _buffer_many(self, records: list[bytes], start: int) -> int:
        """Buffer the records from ``start`` up to the next sync in one step, as many
        ``_write_one`` calls would (0: they must go one by one). Only while a record is
        read ahead: the loop's read-ahead between them then does nothing, so only the
        counters and the buffer change. A record of a bad size, or a rotation among them,
        sends them one by one, where the rules for those are."""
        chunk = records[start:start + self.sync_every - self._count]
        if len(chunk) < 2:
            return 0
        sizes = list(map(len, chunk))
        total = sum(sizes) + 4 * len(sizes)
        if (min(sizes) < self.min_msg_size or max(sizes) > self.max_msg_size
                or self._write_pos + total > self.max_bytes_per_file):
            return 0
        pack = _SIZE.pack
        self._count += len(sizes)
        try:
            self._take_in([pack(size) + data for size, data in zip(sizes, chunk)], total)
        finally:
            self._sync_if_needed()
        return len(sizes)

    def flush(self) -> None:
        """Write the records ``put`` has buffered (``write_buffer``). On failure they are
        dropped (writePos and depth go back to the last written record) and
        DiskQueueError says why: the caller acknowledged them, so it must report it."""
        with self._lock:
            if self._wbuf and not self._closed:
                try:
                    self._flush()
                except OSError as exc:
                    raise DiskQueueError(f"write failed: {exc}") from exc

    @property
    def buffered(self) -> int:
        """Bytes put and not yet written to the file."""
        return self._wbuf_bytes

    def read(self) -> bytes | None:
        """Remove and return the oldest record, or None if the queue has none."""
        with self._lock:
            self._check_open()
            self._begin()
            data, self._pending = self._pending, None
            if data is not None:
                self._count += 1
                self._move_forward()
                self._sync_if_needed()
            return data

    def read_many(self, limit: int) -> list[bytes]:
        """Remove and return up to ``limit`` of the oldest records (fewer, or none, when
        the queue has fewer), as ``read`` called that many times in one instant would:
        the files, syncs and read-ahead change in the same order."""
        records: list[bytes] = []
        with self._lock:
            self._check_open()
            self._begin()
            while len(records) < limit:
                data, self._pending = self._pending, None
                if data is None:
                    break
                records.append(data)
                self._count += 1
                self._move_forward()
                if len(records) < limit:
                    self._take_buffered(records, limit)
                if len(records) == limit:
                    self._sync_if_needed()  # as read ends
                else:
                    self._loop_top()  # that, then what the next read's _begin would do
        return records

    def _take_buffered(self, records: list[bytes], limit: int) -> None:
        """Take the records that follow whole in the read buffer, in one loop, where the
        single steps (read ahead, hand out, move forward) would do nothing else: no sync
        falls due, the file does not end, nothing waits to be written to it. Stops before
        anything else (that step does it), leaving the state a move forward leaves."""
        if self._need_sync or self._read_fd is None or (self._wbuf and self._read_file_num == self._write_file_num):
            return
        finished = self._read_file_num < self._write_file_num
        end = self._max_bytes_per_file_read if finished else self._write_pos
        buf, off, pos, count = self._rbuf, self._rbuf_off, self._read_pos, self._count
        have, lo, hi, last = len(buf), self.min_msg_size, self.max_msg_size, self.sync_every - 1
        unpack = _SIZE.unpack_from
        taken = 0
        while len(records) < limit and count < last and pos < end and have - off >= 4:
            size = unpack(buf, off)[0]
            following = pos + 4 + size
            if size < lo or size > hi or off + 4 + size > have or (finished and following >= end):
                break
            records.append(buf[off + 4 : off + 4 + size])
            off += 4 + size
            pos = following
            count += 1
            taken += 1
        if taken:
            self._rbuf_off, self._count, self._depth = off, count, self._depth - taken
            self._read_pos = self._next_read_pos = pos
            self._check_tail_corruption()

    def peek(self) -> bytes | None:
        """Return the oldest record without removing it, or None if the queue has none."""
        with self._lock:
            self._check_open()
            self._begin()
            return self._pending

    def depth(self) -> int:
        """Records put and not yet read. Counted, not measured; see the module docstring for
        when it is corrected. After close it is the last value."""
        with self._lock:
            if not self._closed:
                self._begin()
            return self._depth

    def empty(self) -> None:
        """Drop every record: delete the data files and the metadata file, and move reader and
        writer to a new file (go-diskqueue ``Empty``/``deleteAllFiles``)."""
        with self._lock:
            self._check_open()
            self._begin()
            self._log.info("DISKQUEUE(%s): emptying", self.name)
            error = self._delete_all_files()
            self._count = 0
            self._sync_if_needed()
        if error is not None:
            raise DiskQueueError(f"empty failed: {error}") from error

    def sync(self) -> None:
        """fsync the write file and persist the metadata (tmp, fsync, rename) now."""
        with self._lock:
            self._check_open()
            self._begin()
            self._count = 0
            try:
                self._sync()
            except OSError as exc:
                raise DiskQueueError(f"sync failed: {exc}") from exc

    def tick(self) -> None:
        """Do the time-driven work: sync if a ``sync_timeout`` tick has passed since activity,
        plus any pending sync or read-ahead. Call it periodically on an idle queue."""
        with self._lock:
            if not self._closed:
                self._begin()

    def close(self) -> None:
        """Sync and close the files. Calling it again does nothing."""
        with self._lock:
            if self._closed:
                return
            self._begin()
            self._closed = True
            self._log.info("DISKQUEUE(%s): closing", self.name)
            try:
                self._sync()
            except OSError as exc:
                raise DiskQueueError(f"close failed to sync: {exc}") from exc
            finally:
                self._close_read()
                self._close_write()

    def delete(self) -> None:
        """Close without syncing and keep every file, like go-diskqueue ``Delete``. nsqd calls
        ``Empty`` first when it deletes a topic; :meth:`destroy` does both."""
        with self._lock:
            if self._closed:
                return
            self._begin()
            self._closed = True
            self._log.info("DISKQUEUE(%s): deleting", self.name)
            self._flush_quietly()
            self._close_read()
            self._close_write()

    def destroy(self) -> None:
        """Close and remove the data files and the metadata file (``Empty`` + ``Delete``).
        ``.bad`` files are kept. Also works after close."""
        with self._lock:
            if not self._closed:
                self._begin()
                self._closed = True
            self._log.info("DISKQUEUE(%s): destroying", self.name)
            error = self._delete_all_files()
        if error is not None:
            raise DiskQueueError(f"destroy failed: {error}") from error

    def __enter__(self) -> DiskQueue:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<DiskQueue {self.name!r} depth={self._depth} read={self._read_file_num},"
            f"{self._read_pos} write={self._write_file_num},{self._write_pos}>"
        )

    def file_name(self, file_num: int) -> str:
        """Path of data file ``file_num``."""
        return os.path.join(self.data_path, "%s.diskqueue.%06d.dat" % (self.name, file_num))

    def metadata_file_name(self) -> str:
        """Path of the metadata file."""
        return os.path.join(self.data_path, f"{self.name}.diskqueue.meta.dat")

    # -- the ioLoop, one step at a time -------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise DiskQueueError("exiting")

    def _begin(self) -> None:
        """Do the loop's pending work, then fire the sync ticker if it is due."""
        self._loop_top()
        now = self._clock()
        if now >= self._next_tick:  # a Go Ticker drops ticks nobody received: fire once
            self._next_tick += (int((now - self._next_tick) // self.sync_timeout) + 1) * self.sync_timeout
            if self._count:
                self._need_sync = True
                self._loop_top()

    def _loop_top(self) -> None:
        while True:
            self._sync_if_needed()
            if self._pending is not None or not self._has_data():
                return
            if self._wbuf and self._read_file_num == self._write_file_num:
                self._flush_quietly()  # the next record may be among them
                continue
            try:
                if self._read_fd is None:
                    self._open_read_file()
                if self._read_file_num < self._write_file_num and self._read_pos == self._max_bytes_per_file_read:
                    self._leave_finished_file()
                    continue
                self._pending = self._read_one()
                return
            except (OSError, _BadRecord) as exc:
                self._log.error(
                    "DISKQUEUE(%s) reading at %d of %s - %s",
                    self.name, self._read_pos, self.file_name(self._read_file_num), exc,
                )
                self._handle_read_error()

    def _sync_if_needed(self) -> None:
        if self._count >= self.sync_every:
            self._need_sync = True
        if self._need_sync:
            try:
                self._sync()
            except OSError as exc:
                self._log.error("DISKQUEUE(%s) failed to sync - %s", self.name, exc)
            self._count = 0

    def _has_data(self) -> bool:
        return self._read_file_num < self._write_file_num or self._read_pos < self._write_pos

    # -- writing ------------------------------------------------------------------------------
    def _write_one(self, data: bytes) -> None:
        size = len(data)
        if size < self.min_msg_size or size > self.max_msg_size:
            raise DiskQueueError(
                f"invalid message write size ({size}) "
                f"minMsgSize={self.min_msg_size} maxMsgSize={self.max_msg_size}"
            )
        total = 4 + size
        if self._write_pos > 0 and self._write_pos + total > self.max_bytes_per_file:
            try:
                self._flush()  # the buffered records belong to the file being finished
            except OSError as exc:
                raise DiskQueueError(f"write failed: {exc}") from exc
            if self._read_file_num == self._write_file_num:
                self._max_bytes_per_file_read = self._write_pos
            self._write_file_num += 1
            self._write_pos = 0
            try:  # sync every time we start a new file: fsyncs the finished one
                self._sync()
            except OSError as exc:
                self._log.error("DISKQUEUE(%s) failed to sync - %s", self.name, exc)
            self._close_write()
        self._take_in([_SIZE.pack(size) + data], total)

    def _take_in(self, records: list[bytes], total: int) -> None:
        """Records (length prefix and payload, ``total`` bytes) into the write buffer,
        counted in writePos and depth; written at once when the buffer is full, else the
        owner is told when they start a new wait."""
        was_empty = not self._wbuf
        self._wbuf += records
        self._wbuf_bytes += total
        self._write_pos += total
        self._depth += len(records)
        if self._wbuf_bytes >= self._write_buffer:
            try:
                self._flush()
            except OSError as exc:
                raise DiskQueueError(f"write failed: {exc}") from exc
        elif was_empty and self._on_buffered is not None:
            self._on_buffered(self)

    def _flush(self) -> None:
        """Write the buffered records in one write(). On OSError, drop them: writePos and
        depth go back to the last record in the file."""
        if not self._wbuf:
            return
        data = self._wbuf[0] if len(self._wbuf) == 1 else b"".join(self._wbuf)
        start = self._write_pos - len(data)
        try:
            if self._write_fd is None:
                file_name = self.file_name(self._write_file_num)
                fd = os.open(file_name, os.O_RDWR | os.O_CREAT, 0o600)
                self._log.info("DISKQUEUE(%s): writeOne() opened %s", self.name, file_name)
                try:
                    if start > 0:
                        os.lseek(fd, start, os.SEEK_SET)
                except OSError:
                    os.close(fd)
                    raise
                self._write_fd = fd
            try:
                _write_all(self._write_fd, data)
            except OSError:
                self._close_write()  # reopening seeks to writePos, over any partial record
                raise
        except OSError:
            self._drop_buffer()
            raise
        self._wbuf.clear()
        self._wbuf_bytes = 0

    def _flush_quietly(self) -> None:
        try:
            self._flush()
        except OSError as exc:
            self._log.error("DISKQUEUE(%s) failed to write buffered records - %s", self.name, exc)

    def _drop_buffer(self) -> None:
        """Forget the buffered records (a failed write, or their file is abandoned)."""
        if self._wbuf:
            self._write_pos -= self._wbuf_bytes
            self._depth -= len(self._wbuf)
            self._wbuf.clear()
            self._wbuf_bytes = 0

    def _sync(self) -> None:
        self._flush()
        if self._write_fd is not None:
            try:
                os.fsync(self._write_fd)
            except OSError:
                self._close_write()
                raise
        self._persist_metadata()
        self._need_sync = False

    def _persist_metadata(self) -> None:
        file_name = self.metadata_file_name()
        tmp_name = f"{file_name}.{random.getrandbits(63)}.tmp"
        text = "%d\n%d,%d\n%d,%d\n" % (
            self._depth, self._read_file_num, self._read_pos, self._write_file_num, self._write_pos
        )
        fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_all(fd, text.encode("ascii"))
            os.fsync(fd)
        except OSError:
            os.close(fd)
            _remove_quietly(tmp_name)
            raise
        os.close(fd)
        os.replace(tmp_name, file_name)

    def _retrieve_metadata(self) -> None:
        file_name = self.metadata_file_name()
        try:
            with open(file_name, "rb") as meta:
                raw = meta.read()
        except FileNotFoundError:
            return  # a new queue
        except OSError as exc:
            self._log.error("DISKQUEUE(%s) failed to retrieveMetaData - %s", self.name, exc)
            return
        match = _META_RE.match(raw)
        if match is None:
            self._log.error("DISKQUEUE(%s) failed to retrieveMetaData - bad format %r", self.name, raw[:80])
            return
        (self._depth, self._read_file_num, self._read_pos, self._write_file_num,
         self._write_pos) = (int(g) for g in match.groups())
        self._next_read_file_num, self._next_read_pos = self._read_file_num, self._read_pos
        # The metadata was not synced at the last shutdown if the write file is longer than
        # writePos: write to a new file and let the reader salvage the old one.
        write_file = self.file_name(self._write_file_num)
        try:
            size = os.stat(write_file).st_size
        except OSError:
            return  # usual after a rotation or a skipped file: created on the next put
        if self._write_pos < size:
            self._log.warning(
                "DISKQUEUE(%s) %s metadata writePos %d < file size of %d, skipping to new file",
                self.name, write_file, self._write_pos, size,
            )
            self._write_file_num += 1
            self._write_pos = 0

    # -- reading ------------------------------------------------------------------------------
    def _open_read_file(self) -> None:
        file_name = self.file_name(self._read_file_num)
        fd = os.open(file_name, os.O_RDONLY)
        self._log.info("DISKQUEUE(%s): readOne() opened %s", self.name, file_name)
        try:
            if self._read_pos > 0:
                os.lseek(fd, self._read_pos, os.SEEK_SET)
            # a finished file is read up to its real size: it may predate a resize
            self._max_bytes_per_file_read = self.max_bytes_per_file
            if self._read_file_num < self._write_file_num:
                self._max_bytes_per_file_read = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            raise
        self._read_fd, self._rbuf, self._rbuf_off = fd, b"", 0

    def _leave_finished_file(self) -> None:
        """The reader read to the end of the write file, then the writer rotated: the
        rotation check in _read_one could not fire then, so move on now. go-diskqueue at
        cc41549 reads here, hits EOF and renames a good file to .bad (its issues #38, #42)."""
        self._close_read()
        self._next_read_file_num, self._next_read_pos = self._read_file_num + 1, 0
        self._move_forward(consumed=False)

    def _read_one(self) -> bytes:
        buf, start = self._rbuf, self._rbuf_off
        if len(buf) - start >= 4:  # most records: the whole of it already in the buffer
            (size,) = _SIZE.unpack_from(buf, start)
            end = start + 4 + size
            if end <= len(buf) and self.min_msg_size <= size <= self.max_msg_size:
                self._rbuf_off = end
                data = buf[start + 4 : end]
            else:
                data, size = self._read_slowly()
        else:
            data, size = self._read_slowly()
        self._next_read_pos = self._read_pos + 4 + size
        self._next_read_file_num = self._read_file_num
        if self._read_file_num < self._write_file_num and self._next_read_pos >= self._max_bytes_per_file_read:
            self._close_read()
            self._next_read_file_num += 1
            self._next_read_pos = 0
        return data

    def _read_slowly(self) -> tuple[bytes, int]:
        """A record that crosses the buffer's end, or is bad: (its payload, its size)."""
        try:
            header = self._read_exact(4)
            if len(header) < 4:
                raise _BadRecord("EOF" if not header else "unexpected EOF")
            (size,) = _SIZE.unpack(header)
            if size < self.min_msg_size or size > self.max_msg_size:
                # corrupt: nothing tells where a next record would begin
                raise _BadRecord(f"invalid message read size ({size})")
            data = self._read_exact(size)
            if len(data) < size:
                raise _BadRecord("unexpected EOF")
        except (OSError, _BadRecord):
            self._close_read()
            raise
        return data, size

    def _read_exact(self, n: int) -> bytes:
        """Up to ``n`` bytes from the read file (fewer only at its end), buffered like bufio."""
        start = self._rbuf_off
        if len(self._rbuf) - start >= n:
            self._rbuf_off = start + n
            return self._rbuf[start : start + n]
        parts = [self._rbuf[start:]]
        need = n - len(parts[0])
        self._rbuf, self._rbuf_off = b"", 0
        fd = self._read_fd
        assert fd is not None  # the reader opened its file before it reads
        while need > 0:
            chunk = os.read(fd, max(need, _READ_CHUNK))
            if not chunk:
                break
            if len(chunk) > need:
                self._rbuf, self._rbuf_off = chunk, need
                chunk = chunk[:need]
            parts.append(chunk)
            need -= len(chunk)
        return b"".join(parts)

    def _move_forward(self, consumed: bool = True) -> None:
        old_file_num = self._read_file_num
        self._read_file_num, self._read_pos = self._next_read_file_num, self._next_read_pos
        if consumed:
            self._depth -= 1
        if old_file_num != self._read_file_num:
            self._need_sync = True  # sync every time we start reading a new file
            file_name = self.file_name(old_file_num)
            try:
                os.remove(file_name)
            except OSError as exc:
                self._log.error("DISKQUEUE(%s) failed to Remove(%s) - %s", self.name, file_name, exc)
        self._check_tail_corruption()

    def _handle_read_error(self) -> None:
        if self._read_file_num == self._write_file_num:
            # cannot read the write file properly: do not append to it any more either
            self._flush_quietly()  # empty here: reading the write file flushed it
            self._close_write()
            self._write_file_num += 1
            self._write_pos = 0
        bad_name = self.file_name(self._read_file_num)
        self._log.warning("DISKQUEUE(%s) jump to next file and saving bad file as %s.bad", self.name, bad_name)
        try:
            os.rename(bad_name, bad_name + ".bad")
        except OSError:
            self._log.error(
                "DISKQUEUE(%s) failed to rename bad diskqueue file %s to %s.bad", self.name, bad_name, bad_name
            )
        self._close_read()
        self._pending = None
        self._read_file_num += 1
        self._read_pos = 0
        self._next_read_file_num, self._next_read_pos = self._read_file_num, 0
        self._need_sync = True
        self._check_tail_corruption()

    def _check_tail_corruption(self) -> None:
        if self._has_data():
            return
        if self._depth != 0:  # at the tail, depth must be 0
            if self._depth < 0:
                what = "negative depth at tail (%d), metadata corruption, resetting 0..."
            else:
                what = "positive depth at tail (%d), data loss, resetting 0..."
            self._log.error("DISKQUEUE(%s) " + what, self.name, self._depth)
            self._depth = 0
            self._need_sync = True
        if self._read_file_num != self._write_file_num or self._read_pos != self._write_pos:
            if self._read_file_num > self._write_file_num:
                self._log.error(
                    "DISKQUEUE(%s) readFileNum > writeFileNum (%d > %d), corruption, "
                    "skipping to next writeFileNum and resetting 0...",
                    self.name, self._read_file_num, self._write_file_num,
                )
            if self._read_pos > self._write_pos:
                self._log.error(
                    "DISKQUEUE(%s) readPos > writePos (%d > %d), corruption, "
                    "skipping to next writeFileNum and resetting 0...",
                    self.name, self._read_pos, self._write_pos,
                )
            self._skip_to_next_rw_file()
            self._need_sync = True

    def _skip_to_next_rw_file(self) -> OSError | None:
        """Delete the data files from reader to writer and start both on a new file."""
        error = None
        self._drop_buffer()
        self._close_read()
        self._close_write()
        for file_num in range(self._read_file_num, self._write_file_num + 1):
            try:
                os.remove(self.file_name(file_num))
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._log.error("DISKQUEUE(%s) failed to remove data file - %s", self.name, exc)
                error = exc
        self._write_file_num += 1
        self._write_pos = 0
        self._read_file_num = self._next_read_file_num = self._write_file_num
        self._read_pos = self._next_read_pos = 0
        self._depth = 0
        self._pending = None
        return error

    def _delete_all_files(self) -> OSError | None:
        error = self._skip_to_next_rw_file()
        try:
            os.remove(self.metadata_file_name())
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._log.error("DISKQUEUE(%s) failed to remove metadata file - %s", self.name, exc)
            return exc
        return error

    def _close_read(self) -> None:
        if self._read_fd is not None:
            fd, self._read_fd = self._read_fd, None
            self._rbuf, self._rbuf_off = b"", 0
            os.close(fd)

    def _close_write(self) -> None:
        if self._write_fd is not None:
            fd, self._write_fd = self._write_fd, None
            os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass

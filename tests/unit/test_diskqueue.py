"""Tests for dmq_client.diskqueue, the go-diskqueue-compatible disk queue.

The first group ports go-diskqueue's own diskqueue_test.go. Go's tests wait for the
ioLoop goroutine with sleeps; these ports are deterministic because time is a fake clock
and work happens inside calls. The rest check the files byte for byte against the format
(records ``[int32 BE len][payload]``, metadata ``"%d\\n%d,%d\\n%d,%d\\n"``), reopening, crash
recovery, sync policy and corruption handling. A hypothesis state machine compares the
queue with a deque.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dmq_client.diskqueue import DiskQueue, DiskQueueError


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def rec(payload: bytes) -> bytes:
    """One record as the format defines it."""
    return struct.pack(">i", len(payload)) + payload


def meta_bytes(depth: int, rfn: int, rpos: int, wfn: int, wpos: int) -> bytes:
    return f"{depth}\n{rfn},{rpos}\n{wfn},{wpos}\n".encode()


def data_file(path: Path, name: str, num: int) -> Path:
    return path / ("%s.diskqueue.%06d.dat" % (name, num))


def meta_file(path: Path, name: str) -> Path:
    return path / f"{name}.diskqueue.meta.dat"


def read_meta(path: Path, name: str) -> tuple[int, ...]:
    depth, read, write = meta_file(path, name).read_text().split("\n")[:3]
    return (int(depth), *map(int, read.split(",")), *map(int, write.split(",")))


def open_dq(path: Path, name: str = "q", **kw) -> DiskQueue:
    kw.setdefault("clock", FakeClock())
    return DiskQueue(name, path, **kw)


def crash(dq: DiskQueue) -> None:
    """Drop the queue like a killed process: close its descriptors, sync nothing."""
    for attr in ("_read_fd", "_write_fd"):
        fd = getattr(dq, attr)
        if fd is not None:
            os.close(fd)
            setattr(dq, attr, None)
    dq._closed = True


# -- ports of diskqueue_test.go ---------------------------------------------------------------


def test_put_read_roundtrip(tmp_path: Path) -> None:
    """TestDiskQueue: one put gives depth 1 and the same bytes come back."""
    with open_dq(tmp_path, max_bytes_per_file=1024, min_msg_size=4, max_msg_size=1 << 10) as dq:
        assert dq.depth() == 0
        dq.put(b"test")
        assert dq.depth() == 1
        assert dq.read() == b"test"
        assert dq.depth() == 0
        assert dq.read() is None


def test_roll(tmp_path: Path) -> None:
    """TestDiskQueueRoll: ten 14-byte records fill a 140-byte file exactly; the 11th
    goes to file 1 (rotation before the write that would pass the limit)."""
    msg = bytes([1, 2, 3, 4, 5, 6, 7, 8, 9, 0])
    with open_dq(tmp_path, max_bytes_per_file=10 * 14, min_msg_size=10, max_msg_size=1 << 10) as dq:
        for i in range(11):
            dq.put(msg)
            assert dq.depth() == i + 1
        assert (dq.write_file_num, dq.write_pos) == (1, 14)
        assert data_file(tmp_path, "q", 0).stat().st_size == 140
        for i in range(11, 0, -1):
            assert dq.read() == msg
            assert dq.depth() == i - 1


def test_roll_with_alternating_put_and_read(tmp_path: Path) -> None:
    """TestDiskQueueRollAsync (newer upstream): put and read alternately across a rotation.
    The reader has read the whole write file when the writer rotates; it must move on
    without an EOF and without renaming the good file to .bad (go-diskqueue issues #38, #42)."""
    msg = bytes([1, 2, 3, 4, 5, 6, 7, 8, 9, 0])
    with open_dq(tmp_path, max_bytes_per_file=10 * 14, min_msg_size=10, max_msg_size=1 << 10) as dq:
        for _ in range(11):
            dq.put(msg)
            assert dq.depth() == 1
            assert dq.read() == msg
            assert dq.depth() == 0
        assert (dq.write_file_num, dq.write_pos) == (1, 14)
        assert not data_file(tmp_path, "q", 0).exists()
    assert list(tmp_path.glob("*.bad")) == []


def test_write_roll_read_eof(tmp_path: Path) -> None:
    """TestWriteRollReadEOF (newer upstream): 205 alternating put/read of 5-byte messages in
    1024-byte files (113 nine-byte records fit in file 0); every message comes back, no .bad file."""
    with open_dq(tmp_path, max_bytes_per_file=1024, min_msg_size=4, max_msg_size=1 << 10) as dq:
        for i in range(205):
            msg = b"%05d" % i
            dq.put(msg)
            assert dq.read() == msg
        assert dq.write_file_num == 1
    assert list(tmp_path.glob("*.bad")) == []


def test_peek(tmp_path: Path) -> None:
    """TestDiskQueuePeek: peek returns the next record and never changes depth, repeated
    or mixed with reads; empty() in between starts each phase clean."""
    msg = bytes(10)
    with open_dq(tmp_path, max_bytes_per_file=10 * 14, min_msg_size=10, max_msg_size=1 << 10) as dq:
        for phase in ("roll", "peek-read", "read-peek"):
            for i in range(10):
                dq.put(msg)
                assert dq.depth() == i + 1
            for i in range(10, 0 if phase != "read-peek" else 1, -1):
                assert dq.peek() == msg
                assert dq.depth() == i
                if phase == "peek-read":
                    assert dq.peek() == msg
                    assert dq.depth() == i
                assert dq.read() == msg
                assert dq.depth() == i - 1
                if phase == "read-peek":
                    assert dq.peek() == msg
                    assert dq.depth() == i - 1
            dq.empty()


def test_empty(tmp_path: Path) -> None:
    """TestDiskQueueEmpty: empty() removes the metadata and every data file, resets depth and
    puts reader and writer at the same new position; the queue keeps working."""
    msg = bytes(10)
    with open_dq(tmp_path, max_bytes_per_file=100, max_msg_size=1 << 10) as dq:
        for i in range(100):
            dq.put(msg)
            assert dq.depth() == i + 1
        for _ in range(3):
            assert dq.read() == msg
        assert dq.depth() == 97
        num_files = dq.write_file_num
        assert num_files == 14  # 7 records of 14 bytes per 100-byte file
        dq.empty()
        assert not meta_file(tmp_path, "q").exists()
        for i in range(num_files + 1):
            assert not data_file(tmp_path, "q", i).exists()
        assert dq.depth() == 0
        assert (dq.read_file_num, dq.read_pos) == (dq.write_file_num, dq.write_pos)
        assert (dq._next_read_file_num, dq._next_read_pos) == (dq.read_file_num, dq.read_pos)
        for i in range(100):
            dq.put(msg)
            assert dq.depth() == i + 1
        for _ in range(100):
            assert dq.read() == msg
        assert dq.depth() == 0
        assert (dq.read_file_num, dq.read_pos) == (dq.write_file_num, dq.write_pos)
        assert dq._next_read_pos == dq.read_pos


def test_corruption(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """TestDiskQueueCorruption, deterministic: truncated or zero-length records make the reader
    rename the file to .bad and go on; if it is the write file the writer moves on too, and
    depth is reset to 0 at the tail. Go's test assumes each truncation lands before the
    ioLoop reads ahead; here read-ahead happens at the start of the next call, so it does."""
    msg = bytearray(120)  # 124-byte records, 8 per 1000-byte file
    msg[0], msg[62], msg[119] = 91, 4, 211
    msg = bytes(msg)
    with open_dq(tmp_path, max_bytes_per_file=1000, min_msg_size=10, max_msg_size=1 << 10, sync_every=5) as dq:
        for _ in range(25):
            dq.put(msg)
        assert dq.depth() == 25
        os.truncate(data_file(tmp_path, "q", 1), 400)  # 3 valid records, 5 lost
        for _ in range(19):  # 8 + 3 + 8; one record left in file 3
            assert dq.read() == msg
        assert data_file(tmp_path, "q", 1).with_suffix(".dat.bad").exists()

        os.truncate(data_file(tmp_path, "q", 3), 100)  # corrupt the current write file
        dq.put(msg)  # the read-ahead fails first, so this goes to a 5th file
        assert dq.write_file_num == 4
        assert data_file(tmp_path, "q", 3).with_suffix(".dat.bad").exists()
        assert dq.read() == msg

        os.write(dq._write_fd, bytes(4))  # a len-0 record in the 5th (current) file
        dq.put(msg)  # into the 5th file, behind the bad record
        dq.put(msg)  # the read-ahead fails on len 0, so this goes to a 6th file
        assert dq.write_file_num == 5
        assert dq.read() == msg

        dq.put(msg)
        dq.put(msg)
        os.truncate(data_file(tmp_path, "q", 5), 100)  # the second record is now cut short
        assert dq.depth() == 2
        assert dq.read() == msg  # was already read ahead
        assert dq.depth() == 0  # the next read-ahead fails: tail reset
        assert dq.read() is None
    bad = sorted(p.name for p in tmp_path.glob("*.bad"))
    assert bad == [f"q.diskqueue.00000{i}.dat.bad" for i in (1, 3, 4, 5)]
    assert "positive depth at tail" in caplog.text


def test_sync_after_read(tmp_path: Path) -> None:
    """TestDiskQueueSyncAfterRead: the sync_timeout ticker persists metadata after puts, and
    also after reads."""
    clock = FakeClock()
    msg = bytes(1000)
    with open_dq(
        tmp_path, max_bytes_per_file=1 << 11, max_msg_size=1 << 10, sync_timeout=0.05, clock=clock
    ) as dq:
        dq.put(msg)
        assert not meta_file(tmp_path, "q").exists()
        clock.advance(0.05)
        dq.tick()
        assert read_meta(tmp_path, "q") == (1, 0, 0, 0, 1004)
        dq.put(msg)
        assert dq.read() == msg
        assert read_meta(tmp_path, "q") == (1, 0, 0, 0, 1004)
        clock.advance(0.05)
        dq.tick()
        assert read_meta(tmp_path, "q") == (1, 0, 1004, 0, 2008)


def test_torture_threads(tmp_path: Path) -> None:
    """TestDiskQueueTorture with fixed counts: 4 threads put concurrently across many files,
    close, reopen: depth equals the puts; 4 threads read everything back exactly once."""
    msg = b"aaaaaaaaaabbbbbbbbbbccccccccccddddddddddeeeeeeeeeeffffffffff"
    writers, per_writer = 4, 500
    dq = open_dq(tmp_path, max_bytes_per_file=4096, max_msg_size=1 << 10)

    def write() -> None:
        for _ in range(per_writer):
            dq.put(msg)

    threads = [threading.Thread(target=write) for _ in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dq.close()
    assert dq.depth() == writers * per_writer

    dq = open_dq(tmp_path, max_bytes_per_file=4096, max_msg_size=1 << 10)
    assert dq.depth() == writers * per_writer
    got: list[bytes] = []

    def read() -> None:
        while (m := dq.read()) is not None:
            got.append(m)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == writers * per_writer
    assert set(got) == {msg}
    assert dq.depth() == 0
    dq.close()


def test_concurrent_puts_and_reads(tmp_path: Path) -> None:
    """Writers and readers at the same time, across many rotations: every record is read
    exactly once and no file is marked bad."""
    writers, per_writer = 3, 400
    dq = open_dq(tmp_path, max_bytes_per_file=512, sync_every=50)
    got: list[bytes] = []
    done = threading.Event()

    def write(w: int) -> None:
        for i in range(per_writer):
            dq.put(b"%d:%04d" % (w, i))

    def read() -> None:
        while not done.is_set():
            m = dq.read()
            if m is not None:
                got.append(m)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in threads + readers:
        t.start()
    for t in threads:
        t.join()
    while dq.depth() > 0:
        pass
    done.set()
    for t in readers:
        t.join()
    dq.close()
    assert sorted(got) == sorted(b"%d:%04d" % (w, i) for w in range(writers) for i in range(per_writer))
    assert list(tmp_path.glob("*.bad")) == []


def test_resize(tmp_path: Path) -> None:
    """TestDiskQueueResize: reopening with a bigger max_bytes_per_file reads the old files up
    to their real size, in order, and leaves no .bad file."""
    msg = bytearray(range(10))
    dq = open_dq(tmp_path, max_bytes_per_file=8 * 14, min_msg_size=10, max_msg_size=1 << 10)
    for i in range(9):
        msg[0] = i
        dq.put(bytes(msg))
    assert (dq.write_file_num, dq.write_pos, dq.depth()) == (1, 14, 9)
    dq.close()
    dq = open_dq(tmp_path, max_bytes_per_file=10 * 14, min_msg_size=10, max_msg_size=1 << 10)
    for i in range(10):
        msg[0] = 20 + i
        dq.put(bytes(msg))
    assert (dq.write_file_num, dq.write_pos, dq.depth()) == (2, 14, 19)
    for first in [*range(9), *range(20, 30)]:
        msg[0] = first
        assert dq.read() == bytes(msg)
    assert dq.depth() == 0
    dq.close()
    assert list(tmp_path.glob("*.bad")) == []


# -- sizes -------------------------------------------------------------------------------------


def test_large_messages(tmp_path: Path) -> None:
    """Records from 16 B to 1 MiB round-trip; a record bigger than max_bytes_per_file goes
    alone into a fresh file, and files never exceed the limit otherwise."""
    sizes = [16, 65536, 1 << 20, 16, 1 << 20, 4096]
    msgs = [bytes([i]) * n for i, n in enumerate(sizes)]
    with open_dq(tmp_path, max_bytes_per_file=100_000, max_msg_size=1 << 20) as dq:
        for m in msgs:
            dq.put(m)
        file_sizes = [data_file(tmp_path, "q", i).stat().st_size for i in range(5)]
        assert file_sizes == [20 + 65540, 4 + (1 << 20), 20, 4 + (1 << 20), 4100]
        assert [dq.read() for _ in msgs] == msgs
        assert sorted(p.name for p in tmp_path.glob("q.diskqueue.0*")) == ["q.diskqueue.000004.dat"]


def test_min_max_size_on_put(tmp_path: Path) -> None:
    """Puts outside [min_msg_size, max_msg_size] fail with go-diskqueue's message, write
    nothing and leave depth alone; the bounds themselves are accepted."""
    with open_dq(tmp_path, min_msg_size=4, max_msg_size=10) as dq:
        for bad in (b"abc", b"x" * 11):
            expected = rf"invalid message write size \({len(bad)}\) minMsgSize=4 maxMsgSize=10"
            with pytest.raises(DiskQueueError, match=expected):
                dq.put(bad)
        assert dq.depth() == 0
        assert not data_file(tmp_path, "q", 0).exists()
        dq.put(b"abcd")
        dq.put(b"x" * 10)
        assert [dq.read(), dq.read()] == [b"abcd", b"x" * 10]


def test_bad_size_on_read_renames_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A record length above max_msg_size in a finished file: the file becomes .bad (bytes
    untouched), the reader goes on with the next file and depth is fixed at the tail."""
    bad_file = rec(b"good0") + struct.pack(">i", 5000) + b"junk"
    data_file(tmp_path, "q", 0).write_bytes(bad_file)
    good = rec(b"good1") + rec(b"good2")
    data_file(tmp_path, "q", 1).write_bytes(good)
    meta_file(tmp_path, "q").write_bytes(meta_bytes(4, 0, 0, 1, len(good)))
    with open_dq(tmp_path, max_msg_size=1024) as dq:
        assert dq.depth() == 4
        assert [dq.read(), dq.read(), dq.read(), dq.read()] == [b"good0", b"good1", b"good2", None]
        assert dq.depth() == 0
    assert (tmp_path / "q.diskqueue.000000.dat.bad").read_bytes() == bad_file
    assert "invalid message read size (5000)" in caplog.text
    assert "positive depth at tail (1), data loss" in caplog.text


# -- the files, byte for byte -----------------------------------------------------------------


def test_writes_exact_bytes(tmp_path: Path) -> None:
    """Data files are exactly the concatenated records, named %06d; the rotation sync writes
    the metadata with the new write file and the depth before the write; close writes the
    final metadata text exactly, and nothing else is left in the directory."""
    with open_dq(tmp_path, "exact", max_bytes_per_file=30) as dq:
        for p in (b"a", b"bb", b""):
            dq.put(p)
        assert not meta_file(tmp_path, "exact").exists()
        dq.put(b"x" * 20)  # 15 + 24 > 30: rotates first
        assert meta_file(tmp_path, "exact").read_bytes() == b"3\n0,0\n1,0\n"
        dq.put(b"yz")  # 24 + 6 == 30: fits
        assert dq.read() == b"a"
        assert dq.read() == b"bb"
    assert sorted(os.listdir(tmp_path)) == [
        "exact.diskqueue.000000.dat", "exact.diskqueue.000001.dat", "exact.diskqueue.meta.dat"
    ]
    assert data_file(tmp_path, "exact", 0).read_bytes() == rec(b"a") + rec(b"bb") + rec(b"")
    assert data_file(tmp_path, "exact", 1).read_bytes() == rec(b"x" * 20) + rec(b"yz")
    assert meta_file(tmp_path, "exact").read_bytes() == b"3\n0,11\n1,30\n"
    assert os.stat(data_file(tmp_path, "exact", 0)).st_mode & 0o777 == 0o600


def test_reads_files_built_by_the_format(tmp_path: Path) -> None:
    """Files written by the format's rules (as nsqd would leave them, partly read, with file
    numbers not starting at 0 and a finished file smaller than the limit) read back exactly,
    and each file is deleted once the reader has passed it."""
    name = "topic:chan"
    first = [b"one", b"two-two", b"three"]
    second = [b"", b"five" * 10, b"six"]
    data_file(tmp_path, name, 7).write_bytes(b"".join(map(rec, first)))
    data_file(tmp_path, name, 8).write_bytes(b"".join(map(rec, second)))
    size8 = sum(4 + len(m) for m in second)
    meta_file(tmp_path, name).write_bytes(meta_bytes(5, 7, 4 + len(first[0]), 8, size8))
    with open_dq(tmp_path, name) as dq:
        assert (dq.read_file_num, dq.read_pos, dq.write_file_num, dq.write_pos) == (7, 7, 8, size8)
        assert dq.depth() == 5
        got = [dq.read() for _ in range(2)]
        assert got == first[1:]
        assert dq.depth() == 3
        assert not data_file(tmp_path, name, 7).exists()
        assert [dq.read() for _ in range(3)] == second
        assert dq.depth() == 0
        assert dq.read() is None
    assert meta_file(tmp_path, name).read_bytes() == meta_bytes(0, 8, size8, 8, size8)
    assert dq.file_name(1234567).endswith("topic:chan.diskqueue.1234567.dat")


def test_metadata_parse_is_lenient_and_bad_metadata_starts_fresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Metadata without the final newline parses (Fscanf does); unreadable metadata is logged
    and the queue starts at zero."""
    data_file(tmp_path, "a", 0).write_bytes(rec(b"m"))
    meta_file(tmp_path, "a").write_bytes(b"1\n0,0\n0,5")
    with open_dq(tmp_path, "a") as dq:
        assert dq.read() == b"m"
    meta_file(tmp_path, "b").write_bytes(b"garbage")
    with open_dq(tmp_path, "b") as dq:
        assert (dq.depth(), dq.read_file_num, dq.write_file_num) == (0, 0, 0)
    assert "failed to retrieveMetaData" in caplog.text


# -- reopening and crashes ----------------------------------------------------------------------


def test_reopen_after_close_continues(tmp_path: Path) -> None:
    """close() persists the positions; a new queue on the same directory continues where
    the old one stopped, for both reader and writer."""
    msgs = [b"m%d" % i for i in range(7)]
    with open_dq(tmp_path, max_bytes_per_file=20) as dq:
        for m in msgs[:5]:
            dq.put(m)
        assert [dq.read(), dq.read()] == msgs[:2]
    assert read_meta(tmp_path, "q") == (3, 0, 12, 1, 12)
    with open_dq(tmp_path, max_bytes_per_file=20) as dq:
        assert dq.depth() == 3
        for m in msgs[5:]:
            dq.put(m)
        assert [dq.read() for _ in range(5)] == msgs[2:]
        assert dq.read() is None


def test_peeked_record_is_read_again_after_reopen(tmp_path: Path) -> None:
    """A peeked (read-ahead) record is not consumed: the metadata keeps it, so a reopened
    queue returns it again. Bytes-like inputs are accepted by put()."""
    with open_dq(tmp_path) as dq:
        dq.put(bytearray(b"first"))
        dq.put(memoryview(b"second"))
        assert dq.peek() == b"first"
    assert read_meta(tmp_path, "q") == (2, 0, 0, 0, 19)
    with open_dq(tmp_path) as dq:
        assert [dq.read(), dq.read(), dq.read()] == [b"first", b"second", None]


def test_crash_rereads_since_last_sync_and_loses_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After a crash the metadata is the last sync's: the writer skips to a new file (the old
    one is longer than writePos), the reader re-reads every record consumed since that sync
    (at-least-once) and every record written, synced or not, is still there. Depth is the
    stale count, goes negative and is reset at the tail, as in go-diskqueue."""
    msgs = [b"msg-%02d" % i for i in range(15)]
    dq = open_dq(tmp_path, sync_every=1000)
    for m in msgs[:10]:
        dq.put(m)
    assert [dq.read(), dq.read()] == msgs[:2]
    dq.sync()
    assert read_meta(tmp_path, "q") == (8, 0, 20, 0, 100)
    for m in msgs[10:]:
        dq.put(m)
    assert [dq.read() for _ in range(3)] == msgs[2:5]
    crash(dq)

    dq = open_dq(tmp_path, sync_every=1000)
    assert (dq.read_file_num, dq.read_pos, dq.write_file_num, dq.write_pos) == (0, 20, 1, 0)
    assert "skipping to new file" in caplog.text
    assert dq.depth() == 8
    got = [dq.read() for _ in range(10)]
    assert dq.depth() == -2
    got += [dq.read() for _ in range(3)]
    assert got == msgs[2:]
    assert dq.depth() == 0
    assert "negative depth at tail (-5), metadata corruption" in caplog.text
    dq.put(b"after")
    assert dq.read() == b"after"
    dq.close()


def test_crash_right_after_rotation(tmp_path: Path) -> None:
    """A crash after the rotation sync (metadata names a write file that holds one unsynced
    record) loses nothing: that file is finished, and new writes go to the next one."""
    dq = open_dq(tmp_path, max_bytes_per_file=3 * 6)
    for m in (b"aa", b"bb", b"cc", b"dd"):
        dq.put(m)
    assert read_meta(tmp_path, "q") == (3, 0, 0, 1, 0)
    crash(dq)
    with open_dq(tmp_path, max_bytes_per_file=3 * 6) as dq:
        assert dq.write_file_num == 2
        dq.put(b"ee")
        assert [dq.read() for _ in range(6)] == [b"aa", b"bb", b"cc", b"dd", b"ee", None]
        assert dq.depth() == 0


def test_metadata_naming_a_missing_write_file(tmp_path: Path) -> None:
    """Metadata may name a write file not created yet (after a skip or rotation): the queue
    opens and the next put creates it."""
    meta_file(tmp_path, "q").write_bytes(meta_bytes(0, 3, 0, 3, 0))
    with open_dq(tmp_path) as dq:
        dq.put(b"x")
        assert data_file(tmp_path, "q", 3).read_bytes() == rec(b"x")
        assert dq.read() == b"x"


# -- tail corruption ----------------------------------------------------------------------------


def test_positive_depth_at_tail_is_reset(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Metadata claiming more records than exist: depth is believed until the reader reaches
    the writer (go-diskqueue only checks there), then it is logged and set to 0."""
    data_file(tmp_path, "q", 0).write_bytes(rec(b"1") + rec(b"2"))
    meta_file(tmp_path, "q").write_bytes(meta_bytes(9, 0, 0, 0, 10))
    with open_dq(tmp_path) as dq:
        assert dq.depth() == 9
        assert [dq.read(), dq.read()] == [b"1", b"2"]
        assert dq.depth() == 0
    assert "positive depth at tail (7), data loss" in caplog.text
    assert read_meta(tmp_path, "q") == (0, 0, 10, 0, 10)


def test_reader_past_writer_skips_to_new_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A record written behind the queue's back moves the reader past writePos: the files
    between reader and writer are dropped and both start on a new file
    (checkTailCorruption -> skipToNextRWFile)."""
    with open_dq(tmp_path) as dq:
        dq.put(b"abcd")  # opens the write file
        assert dq.read() == b"abcd"
        os.write(dq._write_fd, rec(b"x" * 20))  # 24 bytes the queue does not know about
        dq.put(b"yy")  # written at 32, writePos only 14
        assert dq.read() == b"x" * 20  # 8 + 24 = 32 > writePos 14
        assert (dq.read_file_num, dq.read_pos, dq.write_file_num, dq.write_pos) == (1, 0, 1, 0)
        assert dq.depth() == 0
        assert not data_file(tmp_path, "q", 0).exists()
        assert dq.read() is None
    assert "readPos > writePos (32 > 14)" in caplog.text


# -- sync policy ---------------------------------------------------------------------------------


def test_sync_every_counts_puts_and_reads(tmp_path: Path) -> None:
    """Metadata is persisted after every sync_every puts+reads, not before."""
    with open_dq(tmp_path, sync_every=3) as dq:
        dq.put(b"a")
        dq.put(b"b")
        assert not meta_file(tmp_path, "q").exists()
        dq.put(b"c")
        assert read_meta(tmp_path, "q") == (3, 0, 0, 0, 15)
        dq.read()
        dq.read()
        assert read_meta(tmp_path, "q") == (3, 0, 0, 0, 15)
        dq.read()
        assert read_meta(tmp_path, "q") == (0, 0, 15, 0, 15)


def test_reader_changing_file_syncs(tmp_path: Path) -> None:
    """When the reader leaves a file it deletes it and syncs at once."""
    with open_dq(tmp_path, max_bytes_per_file=10) as dq:
        for m in (b"a", b"b", b"c"):
            dq.put(m)
        assert read_meta(tmp_path, "q") == (2, 0, 0, 1, 0)  # from the rotation
        dq.read()
        assert read_meta(tmp_path, "q") == (2, 0, 0, 1, 0)
        dq.read()
        assert read_meta(tmp_path, "q") == (1, 1, 0, 1, 5)
        assert not data_file(tmp_path, "q", 0).exists()


def test_sync_timeout_follows_a_ticker(tmp_path: Path) -> None:
    """sync_timeout acts like Go's Ticker started at open: ticks with no activity since the
    last sync do nothing; after activity the next tick (on its fixed phase) syncs; missed
    ticks fire once. Driven by the injected clock, no sleeping."""
    clock = FakeClock()
    meta = meta_file(tmp_path, "q")
    with open_dq(tmp_path, sync_timeout=1.0, clock=clock) as dq:
        clock.advance(0.5)
        dq.put(b"a")
        clock.advance(0.4)
        dq.tick()
        assert not meta.exists()
        clock.advance(0.1)  # t = 1.0, the first tick
        dq.tick()
        assert read_meta(tmp_path, "q") == (1, 0, 0, 0, 5)
        meta.unlink()
        clock.advance(5.0)  # ticks at 2..6 see no activity
        dq.tick()
        assert not meta.exists()
        clock.advance(0.5)  # t = 6.5
        dq.put(b"b")
        clock.advance(0.4)
        dq.tick()
        assert not meta.exists()
        clock.advance(0.1)  # t = 7.0: the ticker's phase, not 6.5 + 1
        dq.tick()
        assert read_meta(tmp_path, "q") == (2, 0, 0, 0, 10)
        dq.read()
        clock.advance(3.0)
        dq.read()  # the due tick is honoured by any call, not only tick()
        assert read_meta(tmp_path, "q") == (1, 0, 5, 0, 10)


def test_no_tmp_files_left(tmp_path: Path) -> None:
    """Every metadata write renames its tmp file away."""
    with open_dq(tmp_path, sync_every=1) as dq:
        for i in range(20):
            dq.put(b"%d" % i)
            dq.read()
    assert list(tmp_path.glob("*.tmp")) == []


# -- lifecycle -------------------------------------------------------------------------------------


def test_delete_keeps_files_destroy_removes_them(tmp_path: Path) -> None:
    """delete() is go-diskqueue Delete: close without sync, files kept. destroy() is nsqd's
    Empty + Delete: data and metadata files removed, on an open or a closed queue."""
    dq = open_dq(tmp_path, "d")
    dq.put(b"x")
    dq.delete()
    assert data_file(tmp_path, "d", 0).read_bytes() == rec(b"x")
    assert not meta_file(tmp_path, "d").exists()  # never synced
    with pytest.raises(DiskQueueError, match="exiting"):
        dq.put(b"y")

    dq = open_dq(tmp_path, "e", max_bytes_per_file=10)
    for m in (b"a", b"b", b"c", b"d"):
        dq.put(m)
    dq.read()
    dq.destroy()
    assert sorted(p.name for p in tmp_path.glob("e.*")) == []

    with open_dq(tmp_path, "f") as dq:
        dq.put(b"a")
    dq.destroy()
    assert sorted(p.name for p in tmp_path.glob("f.*")) == []


def test_closed_queue(tmp_path: Path) -> None:
    """After close: put/read/peek/empty/sync raise "exiting", depth is the last value,
    close and tick do nothing; the context manager closes."""
    with open_dq(tmp_path) as dq:
        dq.put(b"a")
    assert dq.closed
    for call in (lambda: dq.put(b"b"), dq.read, dq.peek, dq.empty, dq.sync):
        with pytest.raises(DiskQueueError, match="exiting"):
            call()
    assert dq.depth() == 1
    dq.close()
    dq.tick()


def test_bad_arguments(tmp_path: Path) -> None:
    """Nonsense limits and a missing directory are refused at construction."""
    with pytest.raises(ValueError):
        DiskQueue("q", tmp_path, min_msg_size=10, max_msg_size=5)
    with pytest.raises(ValueError):
        DiskQueue("q", tmp_path, sync_timeout=0)
    with pytest.raises(DiskQueueError):
        DiskQueue("q", tmp_path / "missing")


# -- model-based -------------------------------------------------------------------------------------


class DiskQueueMachine(RuleBasedStateMachine):
    """The queue against a deque, across puts, reads, peeks, syncs, ticks, empties and
    close/reopen with a changing small max_bytes_per_file."""

    def __init__(self) -> None:
        super().__init__()
        self.path = Path(tempfile.mkdtemp(prefix="dmq-dq-"))
        self.clock = FakeClock()
        self.model: deque[bytes] = deque()
        self.dq = self._open(64)

    def _open(self, max_bytes: int) -> DiskQueue:
        return DiskQueue(
            "m", self.path, max_bytes_per_file=max_bytes, sync_every=7, sync_timeout=1.0, clock=self.clock
        )

    @rule(data=st.binary(max_size=40))
    def put(self, data: bytes) -> None:
        self.dq.put(data)
        self.model.append(data)

    @rule()
    def read(self) -> None:
        assert self.dq.read() == (self.model.popleft() if self.model else None)

    @rule()
    def peek(self) -> None:
        assert self.dq.peek() == (self.model[0] if self.model else None)

    @rule(max_bytes=st.sampled_from([16, 30, 64, 100]))
    def reopen(self, max_bytes: int) -> None:
        self.dq.close()
        self.dq = self._open(max_bytes)

    @precondition(lambda self: len(self.model) < 5)
    @rule()
    def empty(self) -> None:
        self.dq.empty()
        self.model.clear()

    @rule(seconds=st.sampled_from([0.3, 1.0, 2.5]))
    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.dq.tick()

    @invariant()
    def depth_and_files_match(self) -> None:
        dq = self.dq
        assert dq.depth() == len(self.model)
        expected = set(range(dq.read_file_num, dq.write_file_num)) | ({dq.write_file_num} if dq.write_pos else set())
        names = [p.name.split(".")[2] for p in self.path.glob("m.diskqueue.*.dat")]
        present = {int(n) for n in names if n.isdigit()}
        assert present == expected
        assert not list(self.path.glob("*.bad"))

    def teardown(self) -> None:
        self.dq.close()
        shutil.rmtree(self.path, ignore_errors=True)


TestDiskQueueModel = DiskQueueMachine.TestCase
TestDiskQueueModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_logger_is_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An injected logger receives the queue's messages."""
    logger = logging.getLogger("dmq.test.diskqueue")
    with caplog.at_level(logging.INFO, logger="dmq.test.diskqueue"):
        with DiskQueue("q", tmp_path, logger=logger, clock=FakeClock()) as dq:
            dq.put(b"x")
    assert "DISKQUEUE(q): writeOne() opened" in caplog.text


class BufferedTwinMachine(RuleBasedStateMachine):
    """A queue with a write buffer (the NSQ store's) against one without, fed the same
    calls: every read, peek and depth agrees, and whenever the buffered one has written
    its buffer (flush, sync, close, a read of the write file) the two directories hold
    the same data and metadata files, byte for byte."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="dmq-dq-twin-"))
        (self.root / "plain").mkdir()
        (self.root / "buffered").mkdir()
        self.clock = FakeClock()
        self.noticed = self.noticed_at = 0
        self.plain, self.buffered = self._open(64)

    def _open(self, max_bytes: int) -> tuple[DiskQueue, DiskQueue]:
        def noticed(queue: DiskQueue) -> None:
            self.noticed += 1
            self.noticed_at = queue.buffered

        args = dict(max_bytes_per_file=max_bytes, sync_every=7, sync_timeout=1.0, clock=self.clock)
        return (
            DiskQueue("m", self.root / "plain", **args),
            DiskQueue("m", self.root / "buffered", write_buffer=50, on_buffered=noticed, **args),
        )

    def _same_files(self) -> None:
        assert self.buffered.buffered == 0
        for plain in (self.root / "plain").glob("m.diskqueue.*.dat"):
            if plain.name.endswith(".tmp"):
                continue
            assert (self.root / "buffered" / plain.name).read_bytes() == plain.read_bytes(), plain.name
        plain_names = {p.name for p in (self.root / "plain").glob("*.dat")}
        assert {p.name for p in (self.root / "buffered").glob("*.dat")} == plain_names

    @rule(data=st.binary(max_size=40))
    def put(self, data: bytes) -> None:
        before = self.buffered.buffered
        noticed = self.noticed
        self.plain.put(data)
        self.buffered.put(data)
        # told once when records start waiting, not again while more join them; a
        # rotation writes the waiting ones first, and this record starts a new wait
        # (a sync due after this put may have written it already)
        told = self.noticed - noticed
        assert told in (0, 1)
        if before == 0 and self.buffered.buffered:
            assert told == 1
        if told:
            assert self.noticed_at == 4 + len(data)

    @rule()
    def read(self) -> None:
        assert self.buffered.read() == self.plain.read()

    @rule()
    def peek(self) -> None:
        assert self.buffered.peek() == self.plain.peek()

    @rule()
    def flush(self) -> None:
        self.plain.flush()
        self.buffered.flush()
        self._same_files()

    @rule(max_bytes=st.sampled_from([16, 30, 64, 100]))
    def reopen(self, max_bytes: int) -> None:
        self.plain.close()
        self.buffered.close()
        self._same_files()
        self.plain, self.buffered = self._open(max_bytes)

    @rule()
    def empty(self) -> None:
        self.plain.empty()
        self.buffered.empty()
        self._same_files()

    @rule(seconds=st.sampled_from([0.3, 1.0, 2.5]))
    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.plain.tick()
        self.buffered.tick()

    @invariant()
    def same_view(self) -> None:
        assert self.buffered.depth() == self.plain.depth()
        assert (self.buffered.write_file_num, self.buffered.write_pos) == (self.plain.write_file_num, self.plain.write_pos)
        assert (self.buffered.read_file_num, self.buffered.read_pos) == (self.plain.read_file_num, self.plain.read_pos)

    def teardown(self) -> None:
        self.plain.close()
        self.buffered.close()
        self._same_files()
        shutil.rmtree(self.root, ignore_errors=True)


TestBufferedTwin = BufferedTwinMachine.TestCase


class BatchTwinMachine(RuleBasedStateMachine):
    """``put_many`` and ``read_many`` against ``put`` and ``read`` called once per record
    in the same instant: the same records come back, and after every step the two
    directories hold the same data and metadata files, byte for byte (rotations, syncs
    every 7 operations and the ticker's syncs happen at the same records)."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="dmq-dq-batch-"))
        (self.root / "single").mkdir()
        (self.root / "batch").mkdir()
        self.clock = FakeClock()
        self.single, self.batch = self._open(64)

    def _open(self, max_bytes: int) -> tuple[DiskQueue, DiskQueue]:
        args = dict(max_bytes_per_file=max_bytes, sync_every=7, sync_timeout=1.0, clock=self.clock)
        return DiskQueue("m", self.root / "single", **args), DiskQueue("m", self.root / "batch", **args)

    @rule(records=st.lists(st.binary(max_size=40), max_size=12))
    def put_many(self, records: list[bytes]) -> None:
        for data in records:
            self.single.put(data)
        self.batch.put_many(records)

    @rule(limit=st.integers(min_value=0, max_value=12))
    def read_many(self, limit: int) -> None:
        expected = []
        while len(expected) < limit and (data := self.single.read()) is not None:
            expected.append(data)
        assert self.batch.read_many(limit) == expected

    @rule(max_bytes=st.sampled_from([16, 30, 64, 100]))
    def reopen(self, max_bytes: int) -> None:
        self.single.close()
        self.batch.close()
        self.single, self.batch = self._open(max_bytes)

    @rule(seconds=st.sampled_from([0.3, 1.0, 2.5]))
    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.single.tick()
        self.batch.tick()

    @invariant()
    def same_files(self) -> None:
        single = {p.name: p.read_bytes() for p in (self.root / "single").glob("*.dat")}
        batch = {p.name: p.read_bytes() for p in (self.root / "batch").glob("*.dat")}
        assert batch == single
        assert self.batch.depth() == self.single.depth()

    def teardown(self) -> None:
        self.single.close()
        self.batch.close()
        shutil.rmtree(self.root, ignore_errors=True)


TestBatchTwin = BatchTwinMachine.TestCase
TestBatchTwin.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


class BufferedBatchTwinMachine(BatchTwinMachine):
    """The same twins with a write buffer (the NSQ store's queues): ``put_many`` buffers a
    read-ahead queue's records up to the next sync in one step (``_buffer_many``), and
    after every step, once both have written their buffers, the files are the same byte
    for byte and each queue was told once for each wait its buffer began. Files of up to
    1,000 bytes let runs of records go in one step; 16 and 64 make them rotate among them."""

    def _open(self, max_bytes: int) -> tuple[DiskQueue, DiskQueue]:
        self.told = {"single": 0, "batch": 0}

        def noticed(name: str) -> Callable[[DiskQueue], None]:
            return lambda queue: self.told.__setitem__(name, self.told[name] + 1)

        args = dict(max_bytes_per_file=max_bytes, sync_every=7, sync_timeout=1.0, clock=self.clock, write_buffer=90)
        return (
            DiskQueue("m", self.root / "single", on_buffered=noticed("single"), **args),
            DiskQueue("m", self.root / "batch", on_buffered=noticed("batch"), **args),
        )

    @rule(records=st.lists(st.binary(max_size=40), max_size=12))
    def put_many(self, records: list[bytes]) -> None:
        had = self.batch.buffered
        told = self.told["batch"]
        super().put_many(records)
        if self.batch.buffered and not had:
            assert self.told["batch"] > told  # a wait that began was told
        assert self.batch.depth() == self.single.depth()
        assert self.batch.write_pos == self.single.write_pos

    @rule(max_bytes=st.sampled_from([16, 64, 400, 1000]))
    def reopen(self, max_bytes: int) -> None:
        super().reopen(max_bytes)

    @invariant()
    def same_files(self) -> None:
        self.single.flush()
        self.batch.flush()
        super().same_files()


TestBufferedBatchTwin = BufferedBatchTwinMachine.TestCase
TestBufferedBatchTwin.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


def test_put_many_buffers_a_read_ahead_queues_records_up_to_each_sync_in_one_step(tmp_path: Path) -> None:
    """The NSQ store's case: a buffered queue already holding a record (read ahead) takes a
    batch without a ``_write_one`` per record, syncing where one put at a time would
    (every ``sync_every``), and its files equal those of puts one at a time."""
    args = dict(sync_every=40, write_buffer=4096, clock=FakeClock())
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    one, many = DiskQueue("q", tmp_path / "one", **args), DiskQueue("q", tmp_path / "many", **args)
    records = [bytes([i % 251]) * (20 + i % 13) for i in range(100)]
    one.put(b"first")
    many.put(b"first")
    for data in records:
        one.put(data)
    calls = []
    real = many._write_one
    many._write_one = lambda data: (calls.append(len(data)), real(data))[1]  # type: ignore[method-assign]
    synced = []
    real_sync = many._sync
    many._sync = lambda: (synced.append(many._depth), real_sync())[1]  # type: ignore[method-assign]
    many.put_many(records)
    assert calls == []  # every record went in by the run
    assert synced == [40, 80]  # as one at a time: the 40th and the 80th put
    assert many.depth() == one.depth() == 101
    one.close()
    many.close()
    assert {p.name: p.read_bytes() for p in (tmp_path / "many").iterdir()} == {
        p.name: p.read_bytes() for p in (tmp_path / "one").iterdir()
    }


def test_read_many_takes_records_across_files_and_a_torn_buffer(tmp_path: Path) -> None:
    """Records longer than what the read buffer holds, and files rotated under a small
    limit, come back whole and in order, in batches of any size."""
    records = [bytes([i % 251]) * (1000 + 37 * i) for i in range(300)]  # ~1.9 MB: several 64 KiB reads
    with DiskQueue("r", tmp_path, max_bytes_per_file=100_000, clock=FakeClock()) as dq:
        dq.put_many(records[:150])
        for data in records[150:]:
            dq.put(data)
        got: list[bytes] = []
        for limit in [1, 7, 64, 3] * 200:
            got += dq.read_many(limit)
        assert got == records
        assert dq.read_many(5) == [] and dq.depth() == 0


def test_a_failed_write_of_buffered_records_drops_them_and_says_so(tmp_path: Path, monkeypatch) -> None:
    """The buffered records' write fails: flush raises DiskQueueError, depth and writePos
    go back to the last record written, and the queue goes on with the next puts (the
    file is reopened at writePos, over any partial record)."""
    dq = DiskQueue("f", tmp_path, write_buffer=1000)
    dq.put(b"kept")
    dq.flush()
    dq.put(b"lost-1")
    dq.put(b"lost-2")
    assert dq.depth() == 3 and dq.buffered == 2 * (4 + 6)

    real_write = os.write

    def failing(fd: int, data) -> int:  # noqa: ANN001 - os.write's signature
        real_write(fd, bytes(data)[:5])  # a partial record reaches the file
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", failing)
    with pytest.raises(DiskQueueError, match="No space left"):
        dq.flush()
    monkeypatch.setattr(os, "write", real_write)
    assert dq.depth() == 1 and dq.buffered == 0 and dq.write_pos == 4 + 4
    dq.put(b"after")
    assert [dq.read(), dq.read(), dq.read()] == [b"kept", b"after", None]
    dq.close()
    assert data_file(tmp_path, "f", 0).read_bytes() == rec(b"kept") + rec(b"after")

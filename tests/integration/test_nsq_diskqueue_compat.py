"""go-diskqueue compatibility end to end: a dmq-server's fast-topic files are nsqd's files.

Both directions run through real server processes: what the server spills is read
back with the disk-queue library, and a data directory laid out byte for byte as
nsqd writes it (hand-built records, ``%06d`` names, the text meta file, nsqd.dat)
is served by the server after start.
"""

from __future__ import annotations

import json
import struct

import pytest

from dmq_client.diskqueue import DiskQueue
from dmq_server.core.nsq_wire import decode_message, encode_message

from .support import http_get

pytestmark = pytest.mark.integration


def test_overflow_and_shutdown_files_are_readable_by_the_disk_queue(make_server, tmp_path, nsq_connect):
    """Messages beyond --mem-queue-size and those flushed at shutdown sit in
    <topic>:<channel>.diskqueue.*.dat as nsqd's 26-byte-header records."""
    data = tmp_path / "data"
    server = make_server(data_path=str(data), mem_queue_size=3)
    consumer = nsq_connect(server.tcp_port)
    consumer.sub("spill", "c", rdy=0)
    producer = nsq_connect(server.tcp_port)
    for i in range(10):
        assert producer.pub("spill", b"body-%d" % i) == b"OK"
    producer.close(), consumer.close()
    assert server.terminate() == 0
    nsq_dir = data / "nsq"
    assert (nsq_dir / "spill:c.diskqueue.000000.dat").exists()
    meta = (nsq_dir / "spill:c.diskqueue.meta.dat").read_text()
    depth, read_pos, write_pos = meta.split("\n")[:3]
    assert depth == "10" and read_pos == "0,0"
    dq = DiskQueue("spill:c", nsq_dir, min_msg_size=26, max_msg_size=1024 * 1024 + 26)
    records = []
    while (raw := dq.read()) is not None:
        records.append(decode_message(raw))
    dq.close()
    assert sorted(r[3] for r in records) == [b"body-%d" % i for i in range(10)]
    assert all(len(r[2]) == 16 and r[1] == 0 for r in records)
    assert write_pos == "0,%d" % sum(4 + 26 + len(r[3]) for r in records)


def test_a_data_directory_laid_out_like_nsqd_is_served(make_server, tmp_path, nsq_connect):
    """Hand-written nsqd files (data file, meta text, nsqd.dat) are picked up at start:
    topics, channels and pause flags come back and the stored messages are delivered
    with their attempts."""
    nsq_dir = tmp_path / "data" / "nsq"
    nsq_dir.mkdir(parents=True)
    records = [
        encode_message(1_700_000_000_000_000_000 + i, 2, b"%016x" % (0xABC0 + i), b"from-nsqd-%d" % i)
        for i in range(3)
    ]
    blob = b"".join(struct.pack(">i", len(r)) + r for r in records)
    (nsq_dir / "legacy:workers.diskqueue.000000.dat").write_bytes(blob)
    (nsq_dir / "legacy:workers.diskqueue.meta.dat").write_text(f"3\n0,0\n0,{len(blob)}\n")
    (nsq_dir / "nsqd.dat").write_text(
        json.dumps(
            {
                "topics": [
                    {"channels": [{"name": "workers", "paused": False}, {"name": "idle", "paused": True}],
                     "name": "legacy", "paused": False}
                ],
                "version": "1.3.0",
            }
        )
    )
    server = make_server(data_path=str(tmp_path / "data"))
    consumer = nsq_connect(server.tcp_port)
    consumer.sub("legacy", "workers", rdy=10)
    got = [consumer.message() for _ in range(3)]
    assert sorted(m[3] for m in got) == [b"from-nsqd-0", b"from-nsqd-1", b"from-nsqd-2"]
    assert {m[2] for m in got} == {b"%016x" % (0xABC0 + i) for i in range(3)}
    assert all(m[1] == 3 for m in got)  # attempts survive: 2 stored, +1 for this delivery
    stats = json.loads(http_get(server.http + "/stats?format=json&topic=legacy")[1])
    paused = {c["channel_name"]: c["paused"] for c in stats["topics"][0]["channels"]}
    assert paused == {"idle": True, "workers": False}

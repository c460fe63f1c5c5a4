"""``nsqd.dat``: which topics and channels exist and which are paused.

The same JSON nsqd writes (``{"topics":[{"channels":[{"name","paused"}],"name","paused"}],
"version"}``), so a data directory moves between nsqd and dmq. Written on every
create, delete, pause and at exit: to ``nsqd.dat.<random>.tmp``, fsynced, then
renamed over the old file, so a crash leaves the old or the new file, never half
of one. Ephemeral topics and channels are never written.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["METADATA_FILE", "ChannelMeta", "TopicMeta", "load", "save"]

METADATA_FILE = "nsqd.dat"
VERSION = "1.3.0"


@dataclass
class ChannelMeta:
    name: str
    paused: bool = False


@dataclass
class TopicMeta:
    name: str
    paused: bool = False
    channels: list[ChannelMeta] = field(default_factory=list)


def load(data_dir: Path) -> list[TopicMeta]:
    """The topics recorded in ``nsqd.dat``; empty if there is no file. ValueError if the
    file is not nsqd's JSON."""
    path = Path(data_dir) / METADATA_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    try:
        doc = json.loads(raw)
        topics = []
        for t in doc.get("topics") or []:
            channels = [ChannelMeta(str(c["name"]), bool(c.get("paused", False))) for c in t.get("channels") or []]
            topics.append(TopicMeta(str(t["name"]), bool(t.get("paused", False)), channels))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"failed to parse metadata file {path} - {exc}") from exc
    return topics


def save(data_dir: Path, topics: list[TopicMeta]) -> None:
    doc = {
        "topics": [
            {
                "channels": [{"name": c.name, "paused": c.paused} for c in t.channels],
                "name": t.name,
                "paused": t.paused,
            }
            for t in topics
        ],
        "version": VERSION,
    }
    data = json.dumps(doc, separators=(",", ":")).encode()
    path = Path(data_dir) / METADATA_FILE
    tmp = path.with_name(f"{METADATA_FILE}.{random.getrandbits(63)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)

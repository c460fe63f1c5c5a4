"""What a fast topic and a fast channel need from the store that holds them.

nsqd hands its topics and channels a context rather than the daemon itself; so does
dmq. ``fast.fast_store.FastStore`` provides this protocol, and ``fast.topic`` and
``fast.fast_channel`` depend on the protocol only, so the store imports them and never
the other way round (no import cycle inside the package).
"""

from __future__ import annotations

from typing import Mapping, Protocol, TypeVar

from dmq_server.core.client_memory import ClientMemory
from dmq_server.core.clock import Clock

__all__ = ["Backend", "ChannelHolder", "StoreServices"]

# the channels the store puts under its scanner (``fast_channel.FastChannel``, which
# imports this module: the channel and the topic name it as ``StoreServices[FastChannel]``)
ChannelT = TypeVar("ChannelT", contravariant=True)


class Backend(Protocol):
    """The overflow queue of a topic or channel: go-diskqueue files
    (``dmq_client.diskqueue.DiskQueue``), or ``fast_store.DummyBackend`` that drops them."""

    def put(self, data: bytes) -> None: ...
    def put_many(self, records: list[bytes]) -> None: ...
    def read(self) -> bytes | None: ...
    def read_many(self, limit: int) -> list[bytes]: ...
    def depth(self) -> int: ...
    def empty(self) -> None: ...
    def tick(self) -> None: ...
    def sync(self) -> None: ...
    def close(self) -> None: ...
    def destroy(self) -> None: ...


class ChannelHolder(Protocol):
    """A topic as its channels see it (``topic.FastTopic``): an ephemeral channel's last
    client leaving deletes it there."""

    @property
    def channels(self) -> Mapping[str, object]: ...

    def delete_channel(self, name: str) -> bool: ...


class StoreServices(Protocol[ChannelT]):
    clock: Clock  # IReactorTime: the injected clock
    mem_queue_size: int
    client_memory: ClientMemory | None  # memory queues are bounded in bytes by it too (None: not)
    max_msg_timeout: float
    max_channel_consumers: int
    health_error: str | None

    @property
    def topics(self) -> Mapping[str, ChannelHolder]: ...

    def make_backend(self, name: str, ephemeral: bool) -> Backend:
        """The overflow queue for a topic or channel (go-diskqueue files, or none)."""

    def set_health(self, error: BaseException | str | None) -> None:
        """Report a disk failure (or its end) to the store."""

    def changed(self, thing: object) -> None:
        """A topic or channel was created, deleted, paused or unpaused: save metadata."""

    def delete_topic(self, name: str) -> bool: ...

    def arm(self, channel: ChannelT) -> None:
        """Put a channel with in-flight or deferred messages under the queue scanner."""

    def disarm(self, channel: ChannelT) -> None: ...

"""``Client``: the asyncio client, one object over a connection per configured server.

Settings are ``MqConfig``'s (the same names, defaults and checks as ``MqClient``), given as
keyword arguments or as a config; the few that belong to ``MqClient``'s threads and queues
(``send_queue_size``, ``send_batch_size``, ``handler_threads``, ``ack_wait``) are not used.

With ``zk`` the servers are discovered in the cluster registry by ``dmq_client.discovery``
(``MqClient``'s: kazoo and its threads), and ``servers`` is ignored: the discovery thread's
news reaches the loop through ``call_soon_threadsafe`` (``_servers_changed``), and its
blocking calls (connecting, the first read, closing) run in a worker thread. With
``journal_path`` sends go through the producer journal (``dmq_client.aio.journal``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable, Literal, overload

from .. import otel
from ..config import MqConfig
from ..confirm import CONFIRM_TIMEOUT, Consumed, confirm_deadline_ms
from ..dedup import DedupWindow
from ..message import Message, SendResult
from ..session import default_producer_id
from ..wire import SEND_REPLIES, SUBSCRIBE_REPLIES, Command, Frame, valid_name
from .confirms import Confirmation
from .link import LinkState, ServerLink
from .sends import Sends
from .subscribe import Subscription

if TYPE_CHECKING:
    from ..discovery import ZkDiscovery  # imported at run time only with config.zk (kazoo)
    from .journal import AioJournal

__all__ = ["Client"]

log = logging.getLogger(__name__)


class Client:
    """The asyncio dmq client::

        async with Client(servers=["127.0.0.1:4150"]) as client:
            result = await client.send(Message("orders", b"..."))
            async for message in client.subscribe("orders", "billing", credit=100):
                ...
                await message.ack()

    ``send`` returns ``MqClient``'s ``SendResult`` with the same ``Status`` values, and keeps
    its guarantees: resends under the same session id when no answer came, failover between
    the servers (at once on a lost connection or a ``SERVER_REBOOT``), TLS, ``UP_AUTH``,
    heartbeats. It waits while ``max_in_flight`` sends are unanswered. A cancelled ``send``
    is never half done: see ``dmq_client.aio.sends`` and ``on_cancelled``, which gets the
    one result of every send whose caller was cancelled (``Status.CANCELLED`` if it was
    never written, else its real outcome once known). Leaving ``async with`` (``close()``)
    waits up to ``close_timeout`` for unanswered sends and answers the rest
    ``CLIENT_CLOSED``.

    With ``zk`` the servers are the live nodes of the cluster registry (``servers`` is
    ignored): the client connects to nodes that join, and lets go of nodes that leave, whose
    unanswered sends fail over at once. With ``journal_path`` every send is journaled on
    disk before it is written and forgotten once stored (or refused for good); transient
    failures are retried rather than reported, and what a crashed process left unanswered
    is sent again by the next client opening the journal, under its first producer and
    session ids (``flush()`` waits for those too). See ``dmq_client.aio.sends``.
    """

    def __init__(self, config: MqConfig | None = None, *,
                 on_cancelled: Callable[[SendResult], object] | None = None, **settings: Any):
        if config is None:
            config = MqConfig(**settings)
        elif settings:
            config = config.replace(**settings)
        self.config = config
        self.producer_id = config.producer_id or default_producer_id()
        self.on_cancelled = on_cancelled
        self.links: dict[str, ServerLink] = {}
        self.sends: Sends | None = None
        self.subscriptions: dict[tuple[str, str], Subscription] = {}
        self.dedup = DedupWindow(config.dedup_max_entries, config.dedup_max_age)
        self._ready = asyncio.Event()
        self.closed = False
        self.discovery: ZkDiscovery | None = None  # with config.zk
        self.journal: AioJournal | None = None  # with config.journal_path
        self._generations: dict[str, int] = {}  # of links that left: one that rejoins counts on
        self._leaving: set[asyncio.Task[None]] = set()  # links of departed nodes, closing

    # -- life ----------------------------------------------------------------------------
    async def __aenter__(self) -> "Client":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Start connecting to every server (it does not wait for them: a send waits up
        to ``route_wait`` for a server, ``wait_connected`` as long as you say)."""
        if self.sends is not None:
            return
        if self.config.journal_path is not None:  # first: a journal in use fails the start at once
            from .journal import AioJournal

            self.journal = await AioJournal.open(self.config, self.producer_id)
        servers = list(self.config.servers)
        if self.config.zk:
            servers = await self._discover()
        for name in servers:
            self.links[name] = ServerLink(name, self.config, self)
        self.sends = Sends(self.config, self.producer_id, self.links, self.on_cancelled, journal=self.journal)
        self.sends.start()
        if self.journal is not None:
            self.sends.recover(self.journal.recovered)
        for link in self.links.values():
            link.start()
        if self.discovery is not None:
            self.discovery.watch()  # changes from now on: _servers_changed

    async def wait_connected(self, timeout: float) -> bool:
        """True once any server is connected and ready, False after ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout):
                await self._ready.wait()
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Drain: new sends get CLIENT_CLOSED; unanswered ones get ``close_timeout`` to be
        answered, then CLIENT_CLOSED; subscriptions end; the connections close."""
        if self.closed:
            return
        self.closed = True
        if self.discovery is not None:
            await asyncio.to_thread(self.discovery.close)
        if self.sends is not None:
            await self.sends.close(self.config.close_timeout)
        for sub in list(self.subscriptions.values()):
            sub.end()
        self.subscriptions.clear()
        await asyncio.gather(*(link.close() for link in self.links.values()), *self._leaving)
        if self.journal is not None:
            await self.journal.close()  # synced: what was not stored is kept for the next client

    # -- producing -------------------------------------------------------------------------
    @overload
    async def send(self, message: Message, *, confirm: None = None,
                   confirm_timeout: float = CONFIRM_TIMEOUT) -> SendResult: ...
    @overload
    async def send(self, message: Message, *, confirm: Literal["consumed"],
                   confirm_timeout: float = CONFIRM_TIMEOUT) -> Confirmation: ...

    async def send(self, message: Message, *, confirm: str | None = None,
                   confirm_timeout: float = CONFIRM_TIMEOUT) -> SendResult | Confirmation:
        """Send one message; returns its ``SendResult`` (never raises for the outcome:
        ``result.raise_for_status()`` does).

        ``confirm="consumed"`` asks the server to tell when every channel of the topic is
        done with the message, within ``confirm_timeout`` seconds (up to a day), as
        ``MqClient.send``'s: it returns a ``Confirmation``, ``result, consumed = await
        client.send(...)``, and ``await consumed`` gives the ``Consumed`` outcome (see
        ``dmq_client.aio.confirms``)."""
        return await self._confirming(message, False, confirm, confirm_timeout)

    @overload
    async def resend(self, result: SendResult, *, confirm: None = None,
                     confirm_timeout: float = CONFIRM_TIMEOUT) -> SendResult: ...
    @overload
    async def resend(self, result: SendResult, *, confirm: Literal["consumed"],
                     confirm_timeout: float = CONFIRM_TIMEOUT) -> Confirmation: ...

    async def resend(self, result: SendResult, *, confirm: str | None = None,
                     confirm_timeout: float = CONFIRM_TIMEOUT) -> SendResult | Confirmation:
        """Send a failed message again, idempotently (``MqClient.resend``'s): under the first
        send's producer and session id (``result.producer``: a message recovered from the
        journal keeps its original id), as ``UP_PRODUCER_RESEND``, so the server stores it at
        most once and answers a stored one with its message id (``duplicate``). The safe retry
        of any status, ``OUT_OF_RETRY`` and ``CLIENT_CLOSED`` included; a plain second ``send``
        with that session id is refused once the first was stored. ``confirm="consumed"``: as
        ``send``'s (after a ``LOST`` confirmation, the resend is answered as a duplicate and
        watched by the server it reached)."""
        message = dataclasses.replace(result.message, session_id=result.session_id)
        return await self._confirming(message, True, confirm, confirm_timeout, result.producer or None)

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every send so far has its result, a journal's recovered sends too;
        False if ``timeout`` seconds passed first."""
        if self.sends is None:
            return True
        return await self.sends.wait_idle(timeout)

    async def _confirming(self, message: Message, resend: bool, confirm: str | None,
                          confirm_timeout: float, producer: str | None = None) -> SendResult | Confirmation:
        if confirm is None:
            return await self._send(message, resend, producer=producer)
        confirm_ms = confirm_deadline_ms(confirm, confirm_timeout)
        consumed: asyncio.Future[Consumed] = asyncio.get_running_loop().create_future()
        return Confirmation(await self._send(message, resend, confirm_ms, consumed, producer), consumed)

    async def _send(self, message: Message, resend: bool, confirm_ms: int = 0,
                    consumed: asyncio.Future[Consumed] | None = None, producer: str | None = None) -> SendResult:
        if self.sends is None:
            raise RuntimeError("the client is not started: use `async with Client(...)` or `await client.start()`")
        if not (isinstance(message, Message) and otel.sending(self.config.tracer_provider)):
            return await self.sends.send(message, resend, producer, confirm_ms=confirm_ms, consumed=consumed)
        # the send's span, its context in the message's headers (dmq_client.otel; a resend's
        # message keeps the first send's)
        message, span = otel.start_send(message, self.config.tracer_provider)
        try:
            result = await self.sends.send(message, resend, producer, confirm_ms=confirm_ms, consumed=consumed)
        except BaseException as exc:  # cancelled: the span says so (on_cancelled gets the outcome)
            otel.end_send(span, None, exc)
            raise
        otel.end_send(span, result)
        return result

    # -- consuming ---------------------------------------------------------------------------
    def subscribe(self, topic: str, channel: str, credit: int | None = None) -> Subscription:
        """Subscribe on every server; iterate the result with ``async for``. ``credit``: the
        most unacknowledged messages each server pushes (``default_credit`` if None)."""
        if self.sends is None or self.closed:
            raise RuntimeError("the client is not started or is closed")
        for what, name in (("topic", topic), ("channel", channel)):
            if not isinstance(name, str) or not valid_name(name):
                raise ValueError(f"invalid {what} name {name!r}")
        if (topic, channel) in self.subscriptions:
            raise ValueError(f"already subscribed to {topic}/{channel}")
        credit = self.config.default_credit if credit is None else credit
        if not isinstance(credit, int) or credit < 1:
            raise ValueError(f"credit must be a positive integer, not {credit!r}")
        sub = Subscription(self, topic, channel, credit, self.dedup)
        self.subscriptions[(topic, channel)] = sub
        for link in self.links.values():
            if link.routable:  # the others subscribe when (re)connected: link_ready
                sub.subscribe_on(link)
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        """Forget the subscription; the servers' subscriptions end with their connections
        (the protocol has no unsubscribe), so pushes for it are acked by nobody and come
        back to the channel's other consumers after their timeout."""
        if self.subscriptions.get((sub.topic, sub.channel)) is sub:
            del self.subscriptions[(sub.topic, sub.channel)]

    # -- LinkOwner: what the connections report -------------------------------------------------
    def link_ready(self, link: ServerLink) -> None:
        self._ready.set()
        assert self.sends is not None
        self.sends.link_ready(link)
        for sub in self.subscriptions.values():
            sub.subscribe_on(link)

    def link_leaving(self, link: ServerLink) -> None:
        assert self.sends is not None
        self.sends.link_leaving(link)
        self._ready_again()

    def link_lost(self, link: ServerLink, reason: str) -> None:
        self.link_leaving(link)
        assert self.sends is not None
        self.sends.link_lost(link)
        for sub in self.subscriptions.values():
            sub.link_lost(link)

    def _ready_again(self) -> None:
        if not any(other.state is LinkState.READY for other in self.links.values()):
            self._ready.clear()

    def link_frames(self, link: ServerLink, frames: list[Frame]) -> None:
        replies = []
        for frame in frames:
            command = frame.command
            if command in SEND_REPLIES or command == Command.SEND_CONSUMED_ACK:
                replies.append(frame)  # in order: a send's SUCCESS before its consumption
                continue
            sub = self.subscriptions.get((frame.topic, frame.channel))
            if command == Command.CONSUMER_PUSH:
                if sub is not None:
                    sub.pushed(link, frame)
            elif command == Command.REQUEUE_ACK:
                if sub is not None:
                    sub.requeue_answered(link, frame)
            elif command in SUBSCRIBE_REPLIES:
                if sub is not None:
                    sub.answered(link, frame)
            else:
                log.debug("dmq server %s: ignored %s", link.name, command.name)
        if replies:
            assert self.sends is not None
            self.sends.replies(link, replies)

    # -- ZooKeeper discovery (config.zk) ----------------------------------------------------
    async def _discover(self) -> list[str]:
        """Connect to ZooKeeper and read the live nodes once (in a worker thread: kazoo
        blocks), waiting up to ``connect_timeout``; none if it did not answer in time (the
        discovery thread keeps trying, and its news connects the client later)."""
        from ..discovery import ZkDiscovery

        loop = asyncio.get_running_loop()

        def on_servers(addresses: list[tuple[str, int]]) -> None:  # the discovery thread
            try:
                loop.call_soon_threadsafe(self._servers_changed, addresses)
            except RuntimeError:  # the loop is closed: the client is gone
                pass

        self.discovery = discovery = ZkDiscovery(
            self.config.zk, on_servers,
            session_timeout=self.config.zk_session_timeout, refresh_interval=self.config.zk_refresh_interval,
        )
        try:
            addresses = await asyncio.to_thread(discovery.start, self.config.connect_timeout)
        except BaseException:
            self.discovery = None
            loop.run_in_executor(None, discovery.close)  # not awaited: a cancelled start returns now
            raise
        return [f"{host}:{port}" for host, port in addresses]

    def _servers_changed(self, addresses: list[tuple[str, int]]) -> None:
        """On the loop: connect to nodes that joined, let go of those that left (their
        unanswered sends fail over at once, as on a lost connection). An empty list changes
        nothing: a registry momentarily without nodes must not cut every connection."""
        if not addresses or self.closed or self.sends is None:
            return
        wanted = {f"{host}:{port}" for host, port in addresses}
        for name in sorted(wanted - self.links.keys()):
            link = ServerLink(name, self.config, self)
            # a node back at an address it left: its connections count on from the old ones,
            # so subscriptions (which remember the connection they subscribed on) renew
            link.generation = self._generations.pop(name, 0)
            self.links[name] = link
            log.info("dmq server %s joined the cluster; connecting", name)
            link.start()
        for name in [name for name in self.links if name not in wanted]:
            link = self.links.pop(name)
            self._generations[name] = link.generation
            log.info("dmq server %s left the cluster; disconnecting", name)
            self.link_lost(link, "the node left the cluster")
            closing = asyncio.get_running_loop().create_task(link.close(), name=f"dmq-leave-{name}")
            self._leaving.add(closing)
            closing.add_done_callback(self._leaving.discard)

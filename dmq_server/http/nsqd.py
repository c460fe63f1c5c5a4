"""nsqd's and nsqlookupd's HTTP APIs on dmq's HTTP port (``nsqd/http.go``, ``nsqlookupd/http.go``).

nsqd: ``/ping``, ``/info``, ``/pub`` (``defer``), ``/mpub`` (text and ``binary``),
``/stats`` (``format=json`` in nsqd's shape, ``format=text``), ``/topic/*`` and
``/channel/*`` (create, delete, empty, pause, unpause). nsqlookupd: ``/lookup``,
``/topics``, ``/channels``, ``/nodes``, ``/topic/tombstone`` (``/ping`` and ``/info``
are shared), so a consumer given this port as a lookupd finds this node.

Responses follow nsqd's "V1" convention: a string is sent as text, a structure as
JSON (``Content-Type: application/json; charset=utf-8``), an error as
``{"message": "<TEXT>"}`` with its status, and every one carries
``X-NSQ-Content-Type: nsq; version=1.0`` (go-nsq reads the body as raw JSON only
with it). Parameters come from the query string only. Reliable topics are served
through the broker: ``/pub`` answers only after the PostgreSQL commit.

Why one long module: one short handler per nsqd and nsqlookupd endpoint, as nsqd keeps
its HTTP API in one file (http.go); the shared request parsing is in nsq_v1.py.
"""

from __future__ import annotations

import re
import socket
import time
from typing import Callable, Collection, Mapping, Protocol

from twisted.internet.defer import Deferred, FirstError
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import Request

from dmq_server.admin.inspect import registry_read
from dmq_server.broker.interfaces import BrokerPort
from dmq_server.broker.topic_admin import RegistryOnly
from dmq_server.core.clock import Clock
from dmq_server.core.errors import DmqError, NoChannel, NoTopic
from dmq_server.core.nsq_errors import NsqError
from dmq_server.core.options import Options
from dmq_server.core.publish import Published, PublishRequest
from dmq_server.http.nsq_v1 import (
    NOT_FOUND,
    Answer,
    Body,
    Endpoint,
    Handler,
    Group,
    HttpError,
    PlainText,
    body_of,
    get_param,
    params_of,
    valid_name_str,
)
from dmq_server.core.nsq_identify import (
    MAX_DEFLATE_LEVEL,
    MAX_HEARTBEAT_INTERVAL,
    MAX_OUTPUT_BUFFER_SIZE,
    MAX_OUTPUT_BUFFER_TIMEOUT,
    VERSION,
)
from dmq_server.http.lookupd import LookupdApi, Membership
from dmq_server.http.root import Info, Ping, Root, Stats
from dmq_server.http.stats import memory_stats, reliable_topic_stats, text_stats
from dmq_server.core.nsq_wire import CommandParser
from dmq_server.core.stalls import GcPauses

__all__ = ["install", "NsqHttp"]

log = Logger()

_BOOL = {"true": True, "1": True, "false": False, "0": False}
_INT = re.compile(r"^[+-]?[0-9]+$")


class NsqProducer(Protocol):
    """An NSQ TCP connection as ``/stats`` lists it among the producers
    (``protocols.nsq_v2.NsqConnection``)."""

    @property
    def connect_ts(self) -> int: ...

    @property
    def pub_counts(self) -> Mapping[str, int]: ...

    def stats(self) -> Mapping[str, object]: ...


class NsqShared(Protocol):
    """What the HTTP API shares with the NSQ TCP connections
    (``protocols.nsq_context.NsqContext``): the limits, the clock, the HTTP producer's id
    and the connections."""

    @property
    def max_msg_size(self) -> int: ...

    @property
    def max_body_size(self) -> int: ...

    @property
    def max_req_timeout(self) -> float: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def http_producer(self) -> str: ...

    @property
    def connections(self) -> Collection[NsqProducer]: ...


class NsqHttp(LookupdApi):
    """The handlers. Their collaborators are passed in: what NSQ connections share
    (``ctx``), the broker (the one way to either store: ``broker.interfaces.BrokerPort``),
    the options, the cluster (None on a single node) and ``addresses``, which gives the
    TCP and HTTP ports' (host, port) once they listen."""

    def __init__(
        self,
        *,
        ctx: NsqShared,
        broker: BrokerPort,
        options: Options,
        cluster: Membership | None,
        addresses: Callable[[], tuple[tuple[str, int], tuple[str, int]]],
        dmq_ping: Ping | None,
        dmq_stats: Callable[[], dict] | None,
        dmq_info: Callable[[], dict] | None,
        gc_pauses: GcPauses | None = None,
    ):
        self.ctx = ctx
        self.broker = broker
        self.options = options
        self.cluster = cluster
        self.addresses = addresses
        self.dmq_ping = dmq_ping
        self.dmq_stats = dmq_stats
        self.dmq_info = dmq_info
        self.gc_pauses = gc_pauses  # core.stalls.GcPauses: nsqd's gc_pause_usec_* figures
        self.tombstones: dict[str | tuple[str, str], float] = {}
        self.started = time.time()

    # -- node identity --------------------------------------------------------------------
    def broadcast_address(self) -> str:
        configured = getattr(self.options, "broadcast_address", "")
        if configured:
            return configured
        host = self.addresses()[0][0]
        if host in ("", "0.0.0.0", "::"):
            return socket.gethostname()
        return host

    def peer_info(self) -> dict[str, object]:
        tcp_port = self.addresses()[0][1]
        broadcast = self.broadcast_address()
        return {
            "remote_address": f"{broadcast}:{tcp_port}",
            "hostname": socket.gethostname(),
            "broadcast_address": broadcast,
            "tcp_port": tcp_port,
            "http_port": self.addresses()[1][1],
            "version": VERSION,
            "topology_zone": "",
            "topology_region": "",
        }

    # -- shared ---------------------------------------------------------------------------
    def ping(self, request: Request) -> Answer:
        failing = self.broker.topic_admin.queue_health()
        if failing:
            return PlainText(500, f"NOK - {failing}")
        cluster = self.cluster
        if cluster is not None and not cluster.registered:
            return PlainText(500, "NOK - not registered in the cluster (ZooKeeper) yet")
        if self.dmq_ping is not None:
            return self.dmq_ping.render_GET(request)
        return PlainText(200, "OK")

    def info(self, request: Request) -> dict[str, object]:
        out: dict[str, object] = {
            "version": VERSION,
            "broadcast_address": self.broadcast_address(),
            "hostname": socket.gethostname(),
            "http_port": self.addresses()[1][1],
            "tcp_port": self.addresses()[0][1],
            "start_time": int(self.started),
            "max_heartbeat_interval": int(MAX_HEARTBEAT_INTERVAL * 1e9),
            "max_output_buffer_size": MAX_OUTPUT_BUFFER_SIZE,
            "max_output_buffer_timeout": int(MAX_OUTPUT_BUFFER_TIMEOUT * 1e9),
            "max_deflate_level": MAX_DEFLATE_LEVEL,
            "topology_zone": "",
            "topology_region": "",
        }
        if self.dmq_info is not None:
            for key, value in self.dmq_info().items():
                if key == "version":
                    out["dmq_version"] = value
                else:
                    out.setdefault(key, value)
        return out

    # -- publishing -----------------------------------------------------------------------
    def _topic_param(self, params: dict[str, list[str]], invalid: str = "INVALID_TOPIC") -> str:
        topic = get_param(params, "topic")
        if topic is None:
            raise HttpError(400, "MISSING_ARG_TOPIC")
        if not valid_name_str(topic):
            raise HttpError(400, invalid)
        return topic

    def pub(self, request: Request) -> str | Deferred:
        max_msg = self.ctx.max_msg_size
        length = request.getHeader(b"content-length")
        if length is not None and length.isdigit() and int(length) > max_msg:
            raise HttpError(413, "MSG_TOO_BIG")
        body = body_of(request)
        if len(body) > max_msg:
            raise HttpError(413, "MSG_TOO_BIG")
        if not body:
            raise HttpError(400, "MSG_EMPTY")
        params = params_of(request)
        topic = self._topic_param(params)
        defer_ms = 0
        raw = get_param(params, "defer")
        if raw is not None:
            if not _INT.match(raw):
                raise HttpError(400, "INVALID_DEFER")
            defer_ms = int(raw)
            if defer_ms < 0 or defer_ms > int(self.ctx.max_req_timeout * 1000):
                raise HttpError(400, "INVALID_DEFER")
        return self._publish(topic, [body], defer_ms)

    def mpub(self, request: Request) -> str | Deferred:
        max_body = self.ctx.max_body_size
        length = request.getHeader(b"content-length")
        if length is not None and length.isdigit() and int(length) > max_body:
            raise HttpError(413, "BODY_TOO_BIG")
        params = params_of(request)
        topic = self._topic_param(params)
        binary = False
        raw = get_param(params, "binary")
        if raw is not None:
            binary = _BOOL.get(raw, True)
        body = body_of(request)
        if binary:
            bodies = self._read_mpub(body)
        else:
            if len(body) > max_body:
                raise HttpError(413, "BODY_TOO_BIG")
            bodies = []
            for line in body.split(b"\n"):
                if not line:
                    continue
                if len(line) > self.ctx.max_msg_size:
                    raise HttpError(413, "MSG_TOO_BIG")
                bodies.append(line)
        return self._publish(topic, bodies, 0)

    def _read_mpub(self, body: bytes) -> list[bytes]:
        """nsqd's readMPUB on the request body (no leading size); errors are 413 with the
        TCP code minus ``E_``."""
        parser = CommandParser(self.ctx.max_msg_size, self.ctx.max_body_size)
        size = 1 if body else 0  # the outer size is not sent over HTTP; any valid value
        parser.receive_data(b"MPUB t\n" + size.to_bytes(4, "big") + body)
        try:
            cmd = parser.next_command()
        except NsqError as exc:
            raise HttpError(413, exc.code[2:]) from None
        if cmd is None:  # the body ended early
            if len(body) < 4:
                raise HttpError(413, "BAD_BODY")  # failed to read message count
            raise HttpError(413, "BAD_MESSAGE")
        return cmd.payloads

    def _publish(self, topic: str, bodies: list[bytes], defer_ms: int) -> str | Deferred:
        """One request to the broker (see ``protocols.nsq_v2``): "OK" at once for a
        fast topic, a Deferred firing after commit for a reliable one."""
        now_ms = int(self.ctx.clock.seconds() * 1000)  # the injected clock, as the TCP path
        request = PublishRequest(topic=topic, producer=self.ctx.http_producer, bodies=bodies, produced_ms=now_ms,
                                 due_ms=now_ms + defer_ms if defer_ms else None, create_fast=True)
        later: list[Deferred] = []
        answered: list[str | HttpError] = []

        def done(outcome: Published | BaseException) -> None:
            if later:
                later[0].callback(_publish_reply(outcome))
            else:
                answered.append(_publish_reply(outcome))

        self.broker.publish(request, done)
        if answered:  # a fast topic: answered now, as nsqd
            reply = answered[0]
            if isinstance(reply, HttpError):
                raise reply
            return reply
        later.append(Deferred())
        return later[0]

    # -- stats ----------------------------------------------------------------------------
    def stats(self, request: Request) -> Deferred:
        """Every form of ``/stats``, after a read of the registry (``registry_read``), so a
        reliable channel registered a moment ago is listed, as nsqd lists a new channel."""
        params = params_of(request)
        return registry_read(self.broker, self.ctx.clock).addCallback(lambda _: self._stats(params))

    def _stats(self, params: dict[str, list[str]]) -> Body:
        fmt = get_param(params, "format")
        if fmt is None and self.dmq_stats is not None:
            mine = dict(self.dmq_stats())
            mine["fast_topics"] = self.broker.topic_admin.node_stats(None, True)
            return mine
        topic = get_param(params, "topic")
        channel = get_param(params, "channel")
        include_clients = _BOOL.get(get_param(params, "include_clients") or "", True)
        include_mem = _BOOL.get(get_param(params, "include_mem") or "", True)
        topics = self._topic_stats(topic or None, channel or None, include_clients)
        producers = [c.stats() for c in sorted(self.ctx.connections, key=lambda c: c.connect_ts) if c.pub_counts]
        failing = self.broker.topic_admin.queue_health()
        health = f"NOK - {failing}" if failing else "OK"
        if not self.broker.healthy:
            health = f"NOK - {self.broker.health_detail}"
        if fmt != "json":
            return text_stats(topics, memory_stats(self.gc_pauses) if include_mem else None, health, self.started, producers)
        out: dict[str, object] = {"version": VERSION, "health": health, "start_time": int(self.started), "topics": topics}
        if include_mem:
            out["memory"] = memory_stats(self.gc_pauses)
        out["producers"] = producers or None
        return out

    def _topic_stats(self, topic: str | None, channel: str | None, include_clients: bool) -> list | None:
        by_name = {t["topic_name"]: t for t in self.broker.topic_admin.node_stats(channel, include_clients)}
        for name, row in self.broker.topics.items():
            by_name[name] = reliable_topic_stats(self.broker, name, row, channel, include_clients)
        if topic is not None:
            return [by_name[topic]] if topic in by_name else None
        return [by_name[n] for n in sorted(by_name)]

    # -- topic and channel admin (nsqd) ---------------------------------------------------
    # The broker acts on whichever store holds the topic (``broker.topic_admin``): on a
    # registered topic channel pause, unpause and empty work as on nsqd, creating and
    # deleting are `dmq topic` / `dmq channel`'s, refused here with 400 (never 403, which
    # the Go tools read as "TLS required"). Deleting what is not there answers 200:
    # nsqadmin in lookupd mode sends the same delete to the lookupd and to the node,
    # which on dmq are one URL.
    def topic_create(self, request: Request) -> Deferred | None:
        return _answer(self.broker.topic_admin.create_topic(self._topic_param(params_of(request))))

    def topic_delete(self, request: Request) -> Deferred | None:
        topic = get_param(params_of(request), "topic")
        if topic is None:
            raise HttpError(400, "MISSING_ARG_TOPIC")
        return _answer(self.broker.topic_admin.delete_topic(topic))

    def topic_empty(self, request: Request) -> Deferred | None:
        return _answer(self.broker.topic_admin.empty_topic(self._topic_param(params_of(request))))

    def topic_pause(self, request: Request, pause: bool = True) -> Deferred | None:
        topic = get_param(params_of(request), "topic")
        if topic is None:
            raise HttpError(400, "MISSING_ARG_TOPIC")
        return _answer(self.broker.topic_admin.pause_topic(topic, pause))

    def _topic_channel(self, request: Request) -> tuple[str, str]:
        params = params_of(request)
        topic = self._topic_param(params, "INVALID_ARG_TOPIC")
        channel = get_param(params, "channel")
        if channel is None:
            raise HttpError(400, "MISSING_ARG_CHANNEL")
        if not valid_name_str(channel):
            raise HttpError(400, "INVALID_ARG_CHANNEL")
        return topic, channel

    def channel_create(self, request: Request) -> Deferred | None:
        return _answer(self.broker.topic_admin.create_channel(*self._topic_channel(request)))

    def channel_delete(self, request: Request) -> Deferred | None:
        return _answer(self.broker.topic_admin.delete_channel(*self._topic_channel(request)))

    def channel_empty(self, request: Request) -> Deferred | None:
        return _answer(self.broker.topic_admin.empty_channel(*self._topic_channel(request)))

    def channel_pause(self, request: Request, pause: bool = True) -> Deferred | None:
        topic, name = self._topic_channel(request)
        return _answer(self.broker.topic_admin.pause_channel(topic, name, pause))



_REGISTRY_ONLY = (
    "RELIABLE_TOPIC reliable topics and their channels are created and deleted with "
    "`dmq topic` and `dmq channel` (pause, unpause and empty work here)"
)


def _answer(d: Deferred) -> Deferred | None:
    """A broker action's outcome as an nsqd answer: 200 with no data; 404 for what is not
    there (``TOPIC_NOT_FOUND``, ``CHANNEL_NOT_FOUND``, or a registered channel's name);
    400 for what only the registry changes; 500 when a disk queue or PostgreSQL failed.
    An answer known at once is given at once (a fast store's), raised if an error."""

    def failed(failure: Failure) -> HttpError:
        error = failure.value
        if isinstance(error, FirstError):
            error = error.subFailure.value
        if isinstance(error, RegistryOnly):
            return HttpError(400, _REGISTRY_ONLY)
        if isinstance(error, (NoTopic, NoChannel)):
            return HttpError(404, error.description)
        if isinstance(error, KeyError):
            return HttpError(404, str(error.args[0]))
        log.warn("topic or channel admin failed: {why}", why=error)
        return HttpError(500, "INTERNAL_ERROR")

    now: list[HttpError | None] = []
    d.addCallbacks(lambda _: None, failed).addBoth(now.append)
    if not now:
        return d
    if now[0] is not None:
        raise now[0]
    return None


def install(
    root: Resource,
    *,
    ctx: NsqShared,
    broker: BrokerPort,
    options: Options,
    cluster: Membership | None,
    addresses: Callable[[], tuple[tuple[str, int], tuple[str, int]]],
    gc_pauses: GcPauses | None = None,
) -> NsqHttp:
    """Put nsqd's and nsqlookupd's endpoints on ``root`` (dmq's HTTP root). dmq's own
    ``/ping``, ``/stats`` and ``/info`` keep working: ``/ping`` still checks PostgreSQL,
    ``/stats`` without ``format`` is dmq's JSON, ``/info`` has both sets of fields."""
    old_ping = root.children.get(b"ping")
    old_stats = root.children.get(b"stats")
    old_info = root.children.get(b"info")
    api = NsqHttp(
        ctx=ctx, broker=broker, options=options, cluster=cluster, addresses=addresses, gc_pauses=gc_pauses,
        dmq_ping=old_ping if isinstance(old_ping, Ping) else None,
        dmq_stats=old_stats._stats if isinstance(old_stats, Stats) else None,
        dmq_info=old_info._info if isinstance(old_info, Info) else None,
    )
    GET, POST = b"GET", b"POST"

    def _mount(parent: Resource, name: bytes, routes: dict[bytes, Handler]) -> None:
        # zope's @implementer(IResource) on Resource is invisible to mypy (no zope plugin)
        parent.putChild(name, Endpoint(routes))  # type: ignore[arg-type]

    _mount(root, b"ping", {GET: api.ping})
    _mount(root, b"info", {GET: api.info})
    _mount(root, b"stats", {GET: api.stats})
    _mount(root, b"pub", {POST: api.pub})
    _mount(root, b"mpub", {POST: api.mpub})
    _mount(root, b"lookup", {GET: api.lookup})
    _mount(root, b"topics", {GET: api.topics})
    _mount(root, b"channels", {GET: api.channels})
    _mount(root, b"nodes", {GET: api.nodes})
    topic = Group()
    _mount(topic, b"create", {POST: api.topic_create})
    _mount(topic, b"delete", {POST: api.topic_delete})
    _mount(topic, b"empty", {POST: api.topic_empty})
    _mount(topic, b"pause", {POST: api.topic_pause})
    _mount(topic, b"unpause", {POST: lambda r: api.topic_pause(r, False)})
    _mount(topic, b"tombstone", {POST: api.tombstone})
    root.putChild(b"topic", topic)  # type: ignore[arg-type]  # as in _mount
    channel = Group()
    _mount(channel, b"create", {POST: api.channel_create})
    _mount(channel, b"delete", {POST: api.channel_delete})
    _mount(channel, b"empty", {POST: api.channel_empty})
    _mount(channel, b"pause", {POST: api.channel_pause})
    _mount(channel, b"unpause", {POST: lambda r: api.channel_pause(r, False)})
    root.putChild(b"channel", channel)  # type: ignore[arg-type]  # as in _mount
    if isinstance(root, Root):
        root.not_found = NOT_FOUND
    return api


def _publish_reply(outcome: Published | BaseException) -> str | HttpError:
    """"OK", or the HttpError of a failed publish: nsqd's ``503 EXITING`` when the fast
    store failed (fatal on TCP), else 503 with the broker's code and description (a
    reliable topic: PostgreSQL failing, a refused send; see docs/nsq.md)."""
    if isinstance(outcome, Published):
        return "OK"
    if isinstance(outcome, DmqError):
        return HttpError(503, "EXITING" if outcome.fatal else outcome.status)
    log.error("HTTP publish failed: {error!r}", error=outcome)
    return HttpError(503, repr(outcome))

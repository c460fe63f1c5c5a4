"""NSQ protocol V2 on a connection: the thin adapter between the codec and the stores.

``CommandParser`` turns bytes into commands, one at a time; each ``cmd_*`` method
checks state and parameters in nsqd's order and raises ``ClientError`` or
``FatalClientError`` with nsqd's code and text; only this class decides to close
(after a fatal error's frame is written). Answers leave in command order
(``responses.ResponseQueue``). Messages and heartbeats go out at once.

The connection knows the broker only (``broker.interfaces.BrokerPort``), never which store
serves a topic. Publishes go to it as one ``PublishRequest`` each (a read's run of PUBs
to one topic, an MPUB, a DPUB): ``Broker.publish_each`` answers each PUB of a run,
``Broker.publish`` an MPUB or DPUB once; an answer given before the call returns (a
fast topic's, nsqd's semantics) is written at once, a later one (after a commit) fills
its reserved slot. SUB is ``Broker.attach``, which returns the subscription of the
store serving the topic (``broker.interfaces.Subscription``: FIN a durable ack or nsqd's).

Security is nsqd's: IDENTIFY with ``tls_v1`` (when the server has a certificate) is
answered in plaintext, then the port runs the TLS handshake and ``OK`` follows over TLS
(then deflate, if asked too); while TLS is required every command but IDENTIFY fails
``E_INVALID`` before it. ``AUTH`` and the checks before PUB, MPUB, DPUB and SUB go to
``security.session.ClientAuth``; while it asks the authorizer, this connection runs no
further command (its answers keep their order, and nothing slips past a refusal).

Why one long module: it is one connection's state machine over every NSQ command, each a
short method; split up, the states and the commands that change them would be read in
different files.
"""

from __future__ import annotations

import zlib
from typing import Callable, Protocol, Sequence, cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime, ISSLTransport
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from dmq_server.core.auth import PUBLISH, SUBSCRIBE, AuthState
from dmq_server.core.clock import Timer
from dmq_server.core.errors import AuthFailed, DmqError
from dmq_server.core.peers import peer_address, peer_host
from dmq_server.core.transport import Transport
from dmq_server.broker.interfaces import BrokerPort, Subscription
from dmq_server.core.publish import Published, new_request
from dmq_server.protocols.direct import direct_writer
from dmq_server.protocols.flow import AUTH, NO_GATE, NoGate, ReadGate
from dmq_server.core.nsq_errors import ClientError, CloseSilently, FatalClientError, NsqError
from dmq_server.core.nsq_identify import (
    VERSION,
    ClientSettings,
    deflate_choice,
    identify_reply,
    negotiate,
    parse_identify,
)
from dmq_server.protocols.nsq_context import NsqContext
from dmq_server.protocols.nsq_responses import ResponseQueue, Slot
from dmq_server.protocols.nsq_subscriptions import NsqConsumer
from dmq_server.protocols.turn import TurnBuffer
from dmq_server.security.session import ClientAuth
from dmq_server.security.tls import PeerTls, peer_tls
from dmq_server.core.nsq_wire import (
    CLOSE_WAIT,
    HEARTBEAT,
    MSG_ID_LENGTH,
    OK,
    Command,
    CommandParser,
    as_int64,
    error_frame,
    go_quote,
    message_frame,
    parse_base10,
    response,
    valid_name_bytes,
)

__all__ = ["NsqContext", "NsqConnection", "VERSION"]

log = Logger()

STATE_INIT, STATE_SUBSCRIBED, STATE_CLOSING = 0, 3, 4
#: most bytes inflated from a deflate stream at a time: a small packet can inflate to
#: gigabytes, so the stream is inflated in steps, each parsed before the next
INFLATE_STEP = 65536
#: the frame of an OK response, written as many times over as a run of PUBs has OKs
_OK_FRAME = response(OK)



class FastMessage(Protocol):
    """A message a fast channel sends its client (``send_messages``): nsqd's fields."""

    @property
    def timestamp(self) -> int: ...
    @property
    def attempts(self) -> int: ...
    @property
    def id(self) -> bytes: ...
    @property
    def body(self) -> bytes: ...


class NsqConnection:
    """Serves one client that opened with ``"  V2"``. Also the fast channel's client."""

    def __init__(self, transport: Transport, ctx: NsqContext):
        self.transport = transport
        self._write = direct_writer(transport, self._queued)  # every byte to the client, in order
        self.blocked = False  # the client does not read what it is sent: no messages (output_blocked)
        self.ctx = ctx
        self.clock = ctx.clock
        self.parser = CommandParser(ctx.max_msg_size, ctx.max_body_size, precheck=self._precheck)
        # messages and answers of this reactor turn; held past a stall: _stale_turn
        self._turn = TurnBuffer(self.clock, self._emit, getattr(ctx.broker, "may_push", None), self._stale_turn)
        self.replies = ResponseQueue(self.queue_write, self.close, self._turn.flush)
        self.state = STATE_INIT
        peer = peer_address(transport)
        self.remote_address = peer
        self.client_id = self.hostname = peer.rsplit(":", 1)[0]
        self.user_agent = ""
        self.producer_id = ctx.producer_for(peer)
        self._use_settings(ClientSettings(ctx.heartbeat_interval, ctx.msg_timeout))
        self.rdy = 0
        self.ready_count = 0  # _update_ready
        self.in_flight_count = 0
        self.message_count = self.finish_count = self.requeue_count = 0
        self.pub_counts: dict[str, int] = {}
        self.connect_ts = int(self.clock.seconds())
        self.sub: Subscription | None = None
        self._sub_answered = False
        self.deflate_level = 0  # > 0 once the stream is deflate-compressed
        self._compress: zlib._Compress | None = None
        self._decompress: zlib._Decompress | None = None
        self._inflate_tail = b""  # compressed bytes not inflated yet (paused, or one step at a time)
        self._inflate_more = False  # zlib may hold more output of what it already took
        self.flow: ReadGate | NoGate = NO_GATE  # the port's ReadGate (dmq_server.protocols.flow) once attached
        self._stopped = False  # a fatal error is on its way: read no more commands
        self.closed = False
        self.last_read = self.clock.seconds()
        self._heartbeat: LoopingCall | None = None
        self._deadline: Timer | None = None
        self.secure = ISSLTransport.providedBy(transport)  # TLS (its own port, or upgraded)
        self.start_tls: Callable[[bytes], None] | None = None  # the port's in-band upgrade, when the server has TLS
        self.auth = ClientAuth(ctx.authorizer, self.clock, peer_host(peer), peer, self._peer_tls) if ctx.authorizer else None
        self._held: Deferred | None = None  # a command waiting for the authorizer; nothing runs meanwhile
        # PUBs of one read to one fast topic, published together when the run ends
        # (_flush_pubs); _reading: inside _process, where a run is sure to be flushed
        self._reading = False
        self._pump_later: Subscription | None = None  # the subscription a read's FINs left to pump
        self._pub_topic = ""
        self._pub_bodies: list[bytes] = []
        self._start_heartbeats()
        ctx.connections.add(self)

    # -- what the fast channel reads ------------------------------------------------------
    def _use_settings(self, settings: ClientSettings) -> None:
        """The negotiated settings, and the two a channel reads for every message it
        delivers (``msg_timeout``, ``sample_rate``) as plain attributes."""
        self.settings = settings
        self.msg_timeout = settings.msg_timeout
        self.sample_rate = settings.sample_rate

    def _update_ready(self) -> None:
        """``ready_count``, which a channel reads for every message it pumps: RDY, or 0
        until the SUB's OK has gone out and after CLS. Set when one of those changes."""
        self.ready_count = (
            self.rdy if self._sub_answered and self.state == STATE_SUBSCRIBED and not self.blocked else 0)

    def _queued(self) -> None:
        self.flow.output_queued()

    def output_blocked(self, blocked: bool) -> None:
        """The port's gate: the client's unread bytes passed ``--max-output-buffer``
        (True: its RDY counts as 0, so no channel sends it more), or were all sent."""
        self.blocked = blocked
        self._update_ready()
        if not blocked and self.sub is not None and not self.closed:
            self.sub.pump()

    @property
    def heartbeat_interval(self) -> float:
        return self.settings.heartbeat_interval

    def send_messages(self, channel: object, msgs: Sequence[FastMessage]) -> None:
        """A fast channel's pushes, written when this reactor turn ends."""
        if not self.closed:
            self._turn.extend([message_frame(m.timestamp, m.attempts, m.id, m.body) for m in msgs])

    def channel_closed(self, channel: object) -> None:
        """The channel was deleted (or unregistered): nsqd closes its clients."""
        self.sub = None
        self.close()

    # -- transport side ---------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        """Written now, after what ``queue_write`` holds (the order is the client's)."""
        if not self.closed:
            self._turn.flush()
            self._emit(data)

    def queue_write(self, data: bytes) -> None:
        """Written when this reactor turn ends, with the rest of the turn's (``TurnBuffer``):
        a RDY window's messages, a window of PUBs' OKs, in one write and one deflate flush."""
        if not self.closed:
            self._turn.add(data)

    def queue_writes(self, frames: Sequence[bytes]) -> None:
        """``queue_write`` of each frame, in order (a reliable channel's pushes)."""
        if not self.closed:
            self._turn.extend(frames)

    def _stale_turn(self) -> bool:
        """This turn's bytes were held while the process stood still, and the node may no
        longer push (``protocols.turn``): a subscribed client holding messages may be sent
        copies another node has taken over, so it is closed without them (nsqd's clients
        connect again; its messages go back). Otherwise the bytes are answers, and go."""
        if self.sub is None or not self.sub.in_flight(self):
            return False
        self.close()
        return True

    def _emit(self, data: bytes) -> None:
        """Every byte to the client goes here (so compression applies to all of it)."""
        if self.closed:
            return
        if self._compress is not None:
            data = self._compress.compress(data) + self._compress.flush(zlib.Z_SYNC_FLUSH)
        self._write(data)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.last_read = self.clock.seconds()
        if self._decompress is not None:
            self._inflate_tail += data
            self._inflate()
            return
        self.parser.receive_data(data)
        self._process()

    def _inflate(self) -> None:
        """Inflate and run the kept compressed input, one step at a time, while the
        connection is not paused (what is left waits for ``resume_reading``)."""
        decompress = self._decompress
        if decompress is None:  # the stream is not deflated: nothing is kept to inflate
            return
        while (
            (self._inflate_tail or self._inflate_more)
            and not self._stopped
            and not self.closed
            and not self.flow.paused
            and self._held is None
        ):
            data, self._inflate_tail = self._inflate_tail, b""
            try:
                out = decompress.decompress(data, INFLATE_STEP)
            except zlib.error as exc:
                log.info("{peer}: invalid deflate stream ({why}), closing", peer=self.remote_address, why=exc)
                self._answer(None, FatalClientError("E_INVALID", f"invalid deflate stream: {exc}"))
                return
            self._inflate_tail = decompress.unconsumed_tail
            # a full step may leave output inside zlib even when all input was taken
            self._inflate_more = len(out) == INFLATE_STEP
            self.parser.receive_data(out)
            self._process()

    def resume_reading(self) -> None:
        """The port reads this connection again: first finish the input kept meanwhile."""
        if self._inflate_tail or self._inflate_more:
            self._inflate()

    def buffered(self) -> int:
        """Bytes of incomplete input held (the port's flow control counts them)."""
        return 0 if self.closed else self.parser.buffered() + len(self._inflate_tail)

    def timed_out(self, description: str) -> None:
        """The port's read timeout: an incomplete command took too long."""
        self._answer(None, FatalClientError("E_TIMEOUT", description))

    def _process(self) -> None:
        """Run the commands read so far, in order. A run of PUBs to one fast topic is
        published together, its OKs answered in turn, before anything else is answered
        or run (``cmd_pub``); the slots the read's FINs free are filled by one pump at
        its end (``cmd_fin``)."""
        parser = self.parser
        self._reading = True
        try:
            while not self._stopped and not self.closed and self._held is None:
                try:
                    cmd = parser.next_command()
                    if cmd is None:
                        return
                    self.flow.frame_completed()
                    if self._pub_bodies and cmd.params[0] != b"PUB":
                        self._flush_pubs()
                        if self._stopped or self.closed:
                            return  # the run failed: nothing after it runs (nsqd)
                    self._run(cmd)
                except NsqError as err:
                    self._flush_pubs()
                    if not (self._stopped or self.closed):  # else the run failed before it
                        self._answer(None, err)
                except CloseSilently:
                    self._flush_pubs()
                    log.info("{peer}: command line too long, closing", peer=self.remote_address)
                    self._stopped = True
                    self.close()
        finally:
            self._reading = False
            self._flush_pubs()
            sub, self._pump_later = self._pump_later, None
            if sub is not None:
                sub.pump()  # even if this connection closed meanwhile: others may wait

    def _run(self, cmd: Command) -> None:
        name = cmd.params[0]
        handler = _HANDLERS.get(name)
        if handler is None:
            raise FatalClientError("E_INVALID", f"invalid command {name.decode('utf-8', 'replace')}")
        if self.ctx.tls_required:
            self._check_tls(name)
        handler(self, cmd)

    def _check_tls(self, name: bytes) -> None:
        if self.ctx.tls_required and not self.secure and name != b"IDENTIFY":
            raise FatalClientError("E_INVALID", f"cannot {_text(name)} in current state (TLS required)")

    # -- security: TLS and the authorizer's answers ----------------------------------------
    def _peer_tls(self) -> PeerTls | None:
        return peer_tls(self.transport, self.ctx.tls) if self.secure else None

    def tls_ready(self) -> None:
        """The port's TLS handshake finished (in-band upgrade)."""
        self.secure = True
        tls = self._peer_tls()
        log.info("{peer}: TLS {version} {cipher}", peer=self.remote_address,
                 version=tls.version if tls else "?", cipher=tls.cipher if tls else "?")

    def _allowed(self, cmd: Command, verb: str, permission: str, topic: str, channel: str = "") -> bool:
        """True when the client may; False when the command is held until the
        authorizer answers again (it then runs anew); raises the fatal refusal."""
        if self.auth is None:
            return True
        try:
            waiting = self.auth.check(verb, permission, topic, channel)
        except DmqError as err:
            raise FatalClientError(err.code, err.description) from None
        if waiting is None:
            return True
        self._hold(waiting, lambda: self._run(cmd))
        return False

    def _hold(self, waiting: Deferred, then: Callable[[], None]) -> None:
        """Run nothing else until ``waiting`` fires; then ``then()`` and carry on. An
        answer already there (the auth file) runs ``then()`` at once."""
        if waiting.called:
            then()
            return
        self._held = waiting
        self.flow.hold(AUTH)

        def resume(_: object) -> None:
            self._held = None
            if self.closed or self._stopped:
                return
            try:
                then()
            except NsqError as err:
                self._answer(None, err)
            if self._held is None and not self.closed:
                self.flow.release(AUTH)  # drains kept (inflated) input first
                self._process()

        waiting.addCallback(resume)

    def connection_lost(self) -> None:
        if self._heartbeat is not None and self._heartbeat.running:
            self._heartbeat.stop()
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
        self._deadline = None
        self.ctx.connections.discard(self)
        sub, self.sub = self.sub, None
        if sub is not None:
            sub.detach(self)
        self.replies.clear()
        # what a partial command or kept input held goes now, not when the collector finds this object
        self.parser = CommandParser(self.ctx.max_msg_size, self.ctx.max_body_size)
        self._inflate_tail = b""
        self._pub_bodies = []
        self.closed = True

    def close(self) -> None:
        if not self.closed:
            self._turn.flush()
            self.transport.loseConnection()
            self.flow.closing()  # aborted later if the client never reads the rest
            self.connection_lost()

    def _answer(self, slot: Slot | None, data: bytes | NsqError, after: Callable[[], None] | None = None) -> None:
        """Fill ``slot`` (or answer in turn) with a response or an error frame."""
        if isinstance(data, NsqError):
            if data.fatal:
                self._stopped = True
                log.info("{peer}: fatal error {text}", peer=self.remote_address, text=data.text)
            frame, fatal = error_frame(data), data.fatal
        else:
            frame, fatal = response(data), False
        if slot is None:
            self.replies.reply(frame, fatal, after)
        else:
            self.replies.fill(slot, frame, fatal, after)

    # -- heartbeats and the read deadline -------------------------------------------------
    def _start_heartbeats(self) -> None:
        if self._heartbeat is not None and self._heartbeat.running:
            self._heartbeat.stop()
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
        self._heartbeat = self._deadline = None
        interval = self.heartbeat_interval
        if interval <= 0:
            return
        self._heartbeat = LoopingCall(self._beat)
        # IReactorTime is a zope interface, nominal to mypy; the reactor and task.Clock provide it
        self._heartbeat.clock = cast(IReactorTime, self.clock)
        self._heartbeat.start(interval, now=False)
        self._deadline = self.clock.callLater(2 * interval, self._check_deadline)

    def _beat(self) -> None:
        self.write(response(HEARTBEAT))

    def _check_deadline(self) -> None:
        self._deadline = None
        if self.closed or self.heartbeat_interval <= 0:
            return
        limit = 2 * self.heartbeat_interval
        if self.flow.server_paused:
            self.last_read = self.clock.seconds()  # not read because of the server, not silent
        idle = self.clock.seconds() - self.last_read
        if idle >= limit:
            log.info("{peer}: nothing read for two heartbeat intervals, closing", peer=self.remote_address)
            self.close()
            return
        self._deadline = self.clock.callLater(limit - idle, self._check_deadline)

    # -- checks nsqd makes before reading a body ------------------------------------------
    def _precheck(self, params: list[bytes]) -> None:
        name = params[0]
        self._check_tls(name)
        if name == b"IDENTIFY":
            if self.state != STATE_INIT:
                raise FatalClientError("E_INVALID", "cannot IDENTIFY in current state")
        elif name == b"AUTH":
            if self.state != STATE_INIT:
                raise FatalClientError("E_INVALID", "cannot AUTH in current state")
            if len(params) != 1:
                raise FatalClientError("E_INVALID", "AUTH invalid number of parameters")
        elif name == b"MPUB":
            if len(params) < 2:
                raise FatalClientError("E_INVALID", "MPUB insufficient number of parameters")
            if not valid_name_bytes(params[1]):
                raise FatalClientError(
                    "E_BAD_TOPIC", f"E_BAD_TOPIC MPUB topic name {go_quote(params[1])} is not valid"
                )
        else:  # PUB, DPUB
            cmd = name.decode()
            if len(params) < (3 if name == b"DPUB" else 2):
                raise FatalClientError("E_INVALID", f"{cmd} insufficient number of parameters")
            if not valid_name_bytes(params[1]):
                raise FatalClientError("E_BAD_TOPIC", f"{cmd} topic name {go_quote(params[1])} is not valid")
            if name == b"DPUB":
                self._defer_ms(params[2])

    def _defer_ms(self, raw: bytes) -> int:
        try:
            ms = parse_base10(raw)
        except ValueError:
            raise FatalClientError("E_INVALID", f"DPUB could not parse timeout {_text(raw)}") from None
        max_ms = int(self.ctx.max_req_timeout * 1000)
        if ms > max_ms:
            raise FatalClientError("E_INVALID", f"DPUB timeout {ms} out of range 0-{max_ms}")
        return ms

    # -- IDENTIFY / AUTH ------------------------------------------------------------------
    def cmd_identify(self, cmd: Command) -> None:
        fields = parse_identify(cmd.payload)
        self.client_id = fields.get("client_id", "")
        self.hostname = fields.get("hostname", "")
        self.user_agent = fields.get("user_agent", "")
        ctx = self.ctx
        try:
            settings = negotiate(fields, self.settings, ctx.max_msg_timeout)
        except ValueError as exc:
            raise FatalClientError("E_BAD_BODY", f"IDENTIFY {exc}") from None
        old_interval = self.settings.heartbeat_interval
        self._use_settings(settings)
        if settings.heartbeat_interval != old_interval:
            self._start_heartbeats()
        if not fields.get("feature_negotiation", False):
            self.replies.reply(response(OK))
            return
        deflate, level = deflate_choice(fields, ctx.deflate, ctx.max_deflate_level)
        start_tls = self.start_tls if fields.get("tls_v1") and not self.secure else None
        tls = start_tls is not None
        reply = identify_reply(
            settings,
            max_rdy_count=ctx.max_rdy_count,
            max_msg_timeout=ctx.max_msg_timeout,
            deflate=deflate,
            deflate_level=level,
            max_deflate_level=ctx.max_deflate_level,
            tls_v1=tls,
            auth_required=self.auth is not None,
        )

        def upgrade() -> None:  # nsqd's order: TLS, then compression, each answered OK
            if start_tls is not None:
                self._upgrade_tls(start_tls)
            if deflate:
                self._upgrade_deflate(level)

        self.replies.reply(response(reply), after=upgrade if tls or deflate else None)

    def _upgrade_tls(self, start_tls: Callable[[bytes], None]) -> None:
        """After the IDENTIFY reply (plaintext): the server side of the handshake, then an
        OK, which leaves once the handshake is done. Bytes already read after IDENTIFY
        are the client's first handshake bytes."""
        log.info("{peer}: upgrading connection to TLS", peer=self.remote_address)
        start_tls(self.parser.take_buffered())
        self.write(response(OK))

    def _upgrade_deflate(self, level: int) -> None:
        """After the IDENTIFY reply: raw DEFLATE both ways (sync-flushed per write), then
        an OK through the new stream, as nsqd does."""
        self.deflate_level = level
        self._compress = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)
        self._decompress = zlib.decompressobj(-zlib.MAX_WBITS)
        leftover = self.parser.take_buffered()  # sent before the upgrade: already compressed
        self.write(response(OK))
        if leftover:
            self._inflate_tail = leftover + self._inflate_tail
            self._inflate()  # bad bytes here are answered (E_INVALID) after IDENTIFY's reply

    def cmd_auth(self, cmd: Command) -> None:
        auth = self.auth
        if auth is not None and auth.secret is not None:
            raise FatalClientError("E_INVALID", "AUTH already set")
        if auth is None:
            raise FatalClientError("E_AUTH_DISABLED", "AUTH disabled")
        slot = self.replies.reserve()
        outcome: list[AuthState | Failure] = []
        waiting = auth.login(cmd.payload.decode("utf-8", "replace")).addBoth(outcome.append)

        def answer() -> None:
            result = outcome[0]
            if isinstance(result, Failure):
                error = result.value if isinstance(result.value, DmqError) else AuthFailed("AUTH failed")
                raise FatalClientError(error.code, error.description)
            self._answer(slot, result.reply())

        def run() -> None:
            try:
                answer()
            except NsqError as err:
                self._answer(slot, err)

        self._hold(waiting, run)

    # -- consuming ------------------------------------------------------------------------
    def cmd_sub(self, cmd: Command) -> None:
        params = cmd.params
        if self.state != STATE_INIT:
            raise FatalClientError("E_INVALID", "cannot SUB in current state")
        if self.heartbeat_interval <= 0:
            raise FatalClientError("E_INVALID", "cannot SUB with heartbeats disabled")
        if len(params) < 3:
            raise FatalClientError("E_INVALID", "SUB insufficient number of parameters")
        if not valid_name_bytes(params[1]):
            raise FatalClientError("E_BAD_TOPIC", f"SUB topic name {go_quote(params[1])} is not valid")
        if not valid_name_bytes(params[2]):
            raise FatalClientError("E_BAD_CHANNEL", f"SUB channel name {go_quote(params[2])} is not valid")
        topic, channel = params[1].decode(), params[2].decode()
        if not self._allowed(cmd, "SUB", SUBSCRIBE, topic, channel):
            return
        self.state = STATE_SUBSCRIBED
        self._update_ready()
        slot = self.replies.reserve()
        attached = self.ctx.broker.attach(topic, channel, self, NsqConsumer(self))
        attached.addCallbacks(self._subscribed, self._sub_refused, callbackArgs=(slot,), errbackArgs=(slot, topic, channel))

    def _subscribed(self, sub: Subscription, slot: Slot) -> None:
        if self.closed:  # the client left while the broker looked the topic up
            sub.detach(self)
            return
        self.sub = sub
        self._answer(slot, OK, self._sub_confirmed)

    def _sub_refused(self, failure: Failure, slot: Slot, topic: str, channel: str) -> None:
        """nsqd's E_SUB_FAILED, with the broker's code and description, or the
        channel's own reason (a fast channel closing or full: ``E_SUB_FAILED`` already)."""
        if self.closed:
            return
        error = failure.value
        if isinstance(error, DmqError):
            why = error.description if error.code == "E_SUB_FAILED" else error.status
        else:
            log.failure("SUB {topic}/{channel} failed", failure, topic=topic, channel=channel)
            why = str(error)
        self._answer(slot, FatalClientError("E_SUB_FAILED", f"SUB failed {why}"))

    def _sub_confirmed(self) -> None:
        self._sub_answered = True
        self._update_ready()
        if self.sub is not None:
            self.sub.pump()

    def cmd_rdy(self, cmd: Command) -> None:
        params = cmd.params
        if self.state == STATE_CLOSING:
            return
        if self.state != STATE_SUBSCRIBED:
            raise FatalClientError("E_INVALID", "cannot RDY in current state")
        count = 1
        if len(params) > 1:
            try:
                count = as_int64(parse_base10(params[1]))
            except ValueError:
                raise FatalClientError("E_INVALID", f"RDY could not parse count {_text(params[1])}") from None
        if count < 0 or count > self.ctx.max_rdy_count:
            raise FatalClientError("E_INVALID", f"RDY count {count} out of range 0-{self.ctx.max_rdy_count}")
        self.rdy = count
        self._update_ready()
        if self.sub is not None and self._sub_answered:
            self.sub.pump()

    def _message_id(self, cmd: Command, name: str, want: int) -> bytes:
        if self.state not in (STATE_SUBSCRIBED, STATE_CLOSING):
            raise FatalClientError("E_INVALID", f"cannot {name} in current state")
        if len(cmd.params) < want:
            raise FatalClientError("E_INVALID", f"{name} insufficient number of params")
        message_id = cmd.params[1]
        if len(message_id) != MSG_ID_LENGTH:
            raise FatalClientError("E_INVALID", "invalid message ID")
        return message_id

    def cmd_fin(self, cmd: Command) -> None:
        """FIN. In a read, the FINs that follow this one whole in the input are taken
        with it (``CommandParser.take_fins``) and finished in one call; each refused one
        is answered, in turn, with its own non-fatal ``E_FIN_FAILED``, and the slots they
        free are filled by one pump at the read's end (``_process``)."""
        message_id = self._message_id(cmd, "FIN", 2)
        sub = self.sub
        if sub is None:
            error: str | None = "ID not in flight"
        elif self._reading:
            ids = [message_id]
            self.parser.take_fins(ids)
            self._pump_later = sub
            failed = sub.finish_many(self, ids)
            if not failed:
                return
            for message_id, error in failed[:-1]:
                self._answer(None, ClientError("E_FIN_FAILED", f"FIN {_text(message_id)} failed {error}"))
            message_id, error = failed[-1]
        else:
            error = sub.finish(self, message_id)
        if error is not None:
            raise ClientError("E_FIN_FAILED", f"FIN {_text(message_id)} failed {error}")

    def cmd_req(self, cmd: Command) -> None:
        message_id = self._message_id(cmd, "REQ", 3)
        try:
            ms = parse_base10(cmd.params[2])
        except ValueError:
            raise FatalClientError("E_INVALID", f"REQ could not parse timeout {_text(cmd.params[2])}") from None
        max_ms = int(self.ctx.max_req_timeout * 1000)
        if ms > max_ms:
            log.info("{peer}: REQ timeout {ms} clamped to {max}", peer=self.remote_address, ms=ms, max=max_ms)
            ms = max_ms
        error = self.sub.requeue(self, message_id, ms / 1000.0) if self.sub is not None else "ID not in flight"
        if error is not None:
            raise ClientError("E_REQ_FAILED", f"REQ {_text(message_id)} failed {error}")

    def cmd_touch(self, cmd: Command) -> None:
        message_id = self._message_id(cmd, "TOUCH", 2)
        error = self.sub.touch(self, message_id) if self.sub is not None else "ID not in flight"
        if error is not None:
            raise ClientError("E_TOUCH_FAILED", f"TOUCH {_text(message_id)} failed {error}")

    def cmd_cls(self, cmd: Command) -> None:
        if self.state != STATE_SUBSCRIBED:
            raise FatalClientError("E_INVALID", "cannot CLS in current state")
        self.rdy = 0
        self.state = STATE_CLOSING
        self._update_ready()
        self.replies.reply(response(CLOSE_WAIT))

    def cmd_nop(self, cmd: Command) -> None:
        pass

    # -- publishing -----------------------------------------------------------------------
    def cmd_pub(self, cmd: Command) -> None:
        topic = cmd.params[1].decode()
        if not self._allowed(cmd, "PUB", PUBLISH, topic):
            return
        # the parser reads a PUB's body before it hands PUB on (``cmd.payload`` says so,
        # at the cost of a call a message on the fast path's hottest line)
        body = cmd.body
        assert body is not None
        if self._pub_bodies:
            if topic == self._pub_topic:
                self._pub_bodies.append(body)
                self.parser.take_pubs(self._pub_bodies)
                return
            self._flush_pubs()
            if self._stopped or self.closed:
                return  # the run failed: nothing after it runs (nsqd)
        if self._reading:
            # the PUBs of the same line that follow whole in this read join the run
            # without being parsed, checked and dispatched one by one: the same line
            # passes the same checks (the topic's name, TLS, the authorizer's answer: one
            # that expires while this read is taken in covers the rest of the read)
            self._pub_topic = topic
            self._pub_bodies.append(body)
            self.parser.take_pubs(self._pub_bodies)
            return
        self._publish(topic, [body], 0, "PUB", each=True)

    def _flush_pubs(self) -> None:
        """Publish the run of PUBs ``cmd_pub`` kept as one request, each answered as if
        sent alone (``Broker.publish_each``: a fast topic's run is put on its queues in
        one call, a reliable topic's reaches the group commit in one call), in turn: OK,
        or its error (a fatal one, nsqd's E_PUB_FAILED, closes the connection after the
        first)."""
        bodies = self._pub_bodies
        if not bodies:
            return
        topic, self._pub_bodies = self._pub_topic, []
        self._publish(topic, bodies, 0, "PUB", each=True)

    def cmd_mpub(self, cmd: Command) -> None:
        topic = cmd.params[1].decode()
        if self._allowed(cmd, "MPUB", PUBLISH, topic):
            self._publish(topic, cmd.payloads, 0, "MPUB")

    def cmd_dpub(self, cmd: Command) -> None:
        topic = cmd.params[1].decode()
        if self._allowed(cmd, "DPUB", PUBLISH, topic):
            self._publish(topic, [cmd.payload], self._defer_ms(cmd.params[2]), "DPUB")

    def _publish(self, topic: str, bodies: list[bytes], defer_ms: int, name: str, each: bool = False) -> None:
        """One request to the broker: answered once (MPUB, DPUB: ``Broker.publish``) or
        each body alone (a run of PUBs: ``Broker.publish_each``). Answers given before
        the call returns (a fast topic's, a refusal) are written at once, in turn
        behind earlier answers still awaited; the others (a reliable topic's, after
        commit) fill reply slots reserved in command order, and their bytes count
        against the port's budget until then (dmq_server.protocols.flow)."""
        now_ms = int(self.clock.seconds() * 1000)
        request = new_request(topic=topic, producer=self.producer_id, bodies=bodies, produced_ms=now_ms,
                              due_ms=now_ms + defer_ms if defer_ms else None, create_fast=True)
        count = len(bodies) if each else 1
        early: list[tuple[int, list]] = []  # the answers given before the call returns
        slots: list[Slot | None] = []  # once it returned: the reply slot of each answer still to come

        def answer(start: int, results: list) -> None:
            if not slots:
                early.append((start, results))
                return
            for i, outcome in enumerate(results, start):
                slot = slots[i]
                if slot is None:
                    continue  # answered already, or after a fatal error: nothing to write
                self.flow.sends_done(1, len(bodies[i]) if each else sum(map(len, bodies)))
                if not self.closed:  # the client left before the commit answered
                    self._answer(slot, self._publish_reply(topic, outcome, name))

        if each:
            self.ctx.broker.publish_each(request, answer)
        else:
            self.ctx.broker.publish(request, lambda outcome: answer(0, [outcome]))
        if len(early) == 1 and len(early[0][1]) == count:  # all at once: a fast topic's run, a refusal
            self._answer_now(topic, early[0][1], name)
            return
        # None: not answered yet when Broker.publish or publish_each returned
        outcomes: list[Published | BaseException | None] = [None] * count
        for start, results in early:
            outcomes[start : start + len(results)] = results
        replies = self.replies
        reserved: list[Slot | None] = []
        for i, outcome in enumerate(outcomes):
            if outcome is None and not (self._stopped or self.closed):
                reserved.append(replies.reserve())
                self.flow.sends_started(1, len(bodies[i]) if each else sum(map(len, bodies)))
            else:
                reserved.append(None)
                if outcome is not None:
                    self._answer_now(topic, (outcome,), name)
        slots[:] = reserved

    def _answer_now(self, topic: str, outcomes: Sequence[Published | BaseException], name: str) -> None:
        """Answers known now, each in turn (behind earlier ones still awaited); a fast
        run's one outcome is counted and framed once. Nothing after a fatal one."""
        replies = self.replies
        count = len(outcomes)
        if count > 1 and not len(replies) and not (self._stopped or self.closed):
            first = outcomes[0]
            if isinstance(first, Published) and outcomes.count(first) == count:
                # a fast run's: every PUB answered OK, nothing awaited before them, so
                # the OKs are one write of the same frame, not a reply each
                self._publish_reply(topic, first, name)
                replies.reply(_OK_FRAME * count)
                return
        last: Published | BaseException | None = None
        reply: bytes | NsqError = OK
        for outcome in outcomes:
            if self._stopped or self.closed:
                return
            if outcome is not last:
                last, reply = outcome, self._publish_reply(topic, outcome, name)
            self._answer(replies.reserve() if len(replies) else None, reply)

    def _publish_reply(self, topic: str, outcome: Published | BaseException, name: str) -> bytes | NsqError:
        """OK, or the error frame of a failed publish: fatal with nsqd's text when the
        broker says so (a fast topic closing or its disk queue failing, as nsqd),
        otherwise non-fatal with the broker's code (a reliable topic: see docs/nsq.md)."""
        if isinstance(outcome, Published):
            self.pub_counts[topic] = self.pub_counts.get(topic, 0) + outcome.count
            return OK
        if isinstance(outcome, DmqError):
            if outcome.fatal:
                return FatalClientError(f"E_{name}_FAILED", f"{name} failed {outcome.description}")
            return ClientError(f"E_{name}_FAILED", f"{name} failed {outcome.status}")
        log.error("{name} failed: {error!r}", name=name, error=outcome)
        return ClientError(f"E_{name}_FAILED", f"{name} failed {outcome!r}")

    # -- introspection --------------------------------------------------------------------
    def stats(self) -> dict[str, object]:
        """nsqd's ClientStats shape."""
        out: dict[str, object] = {
            "client_id": self.client_id,
            "hostname": self.hostname,
            "version": "V2",
            "remote_address": self.remote_address,
            "state": self.state,
            "ready_count": self.rdy,
            "in_flight_count": self.sub.in_flight(self) if self.sub is not None else 0,
            "message_count": self.message_count,
            "finish_count": self.finish_count,
            "requeue_count": self.requeue_count,
            "connect_ts": self.connect_ts,
            "sample_rate": self.sample_rate,
            "deflate": self.deflate_level > 0,
            "snappy": False,
            "user_agent": self.user_agent,
            "tls": False,
            "tls_cipher_suite": "",
            "tls_version": "",
            "tls_negotiated_protocol": "",
            "tls_negotiated_protocol_is_mutual": False,
            "topology_zone": "",
            "topology_region": "",
            "authed": False,
        }
        tls = self._peer_tls()
        if tls is not None:
            out.update(tls=True, tls_cipher_suite=tls.cipher, tls_version=tls.version)
        if self.auth is not None:
            out.update(self.auth.stats())
        if self.pub_counts:
            out["pub_counts"] = [{"topic": t, "count": n} for t, n in sorted(self.pub_counts.items())]
        return out


_HANDLERS: dict[bytes, Callable[[NsqConnection, Command], None]] = {
    b"FIN": NsqConnection.cmd_fin,
    b"RDY": NsqConnection.cmd_rdy,
    b"REQ": NsqConnection.cmd_req,
    b"PUB": NsqConnection.cmd_pub,
    b"MPUB": NsqConnection.cmd_mpub,
    b"DPUB": NsqConnection.cmd_dpub,
    b"NOP": NsqConnection.cmd_nop,
    b"TOUCH": NsqConnection.cmd_touch,
    b"SUB": NsqConnection.cmd_sub,
    b"CLS": NsqConnection.cmd_cls,
    b"AUTH": NsqConnection.cmd_auth,
    b"IDENTIFY": NsqConnection.cmd_identify,
}


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")

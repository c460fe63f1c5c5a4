"""The dmq wire protocol on a connection: frames in, broker calls, frames out.

A thin adapter: the codec parses, the broker decides, this class only maps
commands to broker calls and outcomes to reply frames, and decides when to
close (protocol errors, silent peers). It is handed the transport after the
port's first four bytes chose this protocol.

With authentication on, ``UP_AUTH`` (its body the secret; empty: the verified client
certificate) is answered ``AUTH_ACK`` or a fatal ``PROTOCOL_ERROR``; every send and
subscribe is checked by ``security.session.ClientAuth`` and one refused gets its own
``*_INVALID_ACK`` (``E_AUTH_FIRST``, ``E_UNAUTHORIZED``), failing nothing else. While the
authorizer is asked again (the answer's ttl ran out), this connection's frames wait, in
order, and the port does not read it.

Why one long module: it is one connection's commands, each a short method, and the
authentication hold that orders them; split, the frames and the state that gates them
would be read in different files.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Protocol, Sequence, cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime, ISSLTransport
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from dmq_client.wire import (
    CONFIRM_MAX_MS,
    SERVER_FEATURES,
    Command,
    Frame,
    FrameDecoder,
    FrameError,
    MessageType,
    encode,
    unpack_ids,
)
from dmq_client.wire.codec import MIN_FRAME_SIZE, PushEncoder, SendReplyEncoder
from dmq_client.wire.properties import PropertiesError, decode_properties

from dmq_server.broker.interfaces import BrokerPort, ChannelRef, Pushed
from dmq_server.core.auth import PUBLISH, SUBSCRIBE, AuthState
from dmq_server.core.clock import Clock, Timer
from dmq_server.core.errors import (
    AuthFailed,
    DmqError,
    Invalid,
    NoChannel,
    NoTopic,
    RateLimited,
    Refused,
    Unavailable,
    reply_for,
)
from dmq_server.core.peers import peer_address, peer_host
from dmq_server.core.transport import Transport
from dmq_server.core.publish import Published, PublishRequest, Send, new_request, new_send
from dmq_server.protocols.direct import direct_writer
from dmq_server.protocols.flow import AUTH, NO_GATE, NoGate, ReadGate
from dmq_server.protocols.turn import TurnBuffer
from dmq_server.security.authorizer import Authorizer
from dmq_server.security.session import ClientAuth
from dmq_server.security.tls import PeerTls, ServerTls, peer_tls

__all__ = ["DmqConnection", "DmqSubscription", "PumpedChannel"]

log = Logger()

# The reply to each broker error (core.errors) a send or subscribe can end with; the
# status carries the error's code and description. An error of no family is a bug,
# answered as a server error and logged.
_SEND_REPLY: dict[type[DmqError], Command] = {
    Invalid: Command.SEND_INVALID_ACK,
    NoTopic: Command.SEND_NO_TOPIC_ACK,
    RateLimited: Command.SEND_EXCEED_LIMIT_ACK,
    Refused: Command.SEND_INVALID_ACK,
    DmqError: Command.SEND_SERVER_ERROR,
}
_SUBSCRIBE_REPLY: dict[type[DmqError], Command] = {
    Invalid: Command.SUBSCRIBE_INVALID_ACK,
    NoTopic: Command.SUBSCRIBE_NO_TOPIC_ACK,
    NoChannel: Command.SUBSCRIBE_NO_CLIENT_ID_ACK,
    Refused: Command.SUBSCRIBE_INVALID_ACK,
    Unavailable: Command.SUBSCRIBE_SERVER_ERROR,
    DmqError: Command.SUBSCRIBE_SERVER_ERROR,
}


_SENDS = (Command.UP_PRODUCER_SEND, Command.UP_PRODUCER_RESEND)
_FEATURES = SERVER_FEATURES.encode()


def _run_end(frames: list[Frame], start: int) -> int:
    """The end of the run of sends at ``start``: the frames after it that are sends too,
    not delayed, from the same producer to the same topic."""
    first = frames[start]
    topic, producer = first.topic, first.producer
    end = start + 1
    for frame in frames[start + 1:]:
        if (frame.command not in _SENDS or frame.topic != topic or frame.producer != producer
                or frame.msg_type == MessageType.DELAY):
            break
        end += 1
    return end


class PumpedChannel(ChannelRef, Protocol):
    """The channel a subscription is attached to (what ``Broker.subscribe`` fires):
    asked to push again when the client's credit grows."""

    def pump(self) -> None: ...


class DmqSubscription:
    """One (topic, channel) a connection consumes, with its own credit window: the
    consumer a reliable channel (``reliable.channel.ReliableChannel``) pushes deliveries to."""

    def __init__(self, connection: "DmqConnection", credit: int):
        self.connection = connection
        self._credit = credit
        self.in_flight = 0
        self.channel: PumpedChannel | None = None
        # how the message trace and the console name this consumer
        self.name = f"dmq {connection.peer}"

    @property
    def credit(self) -> int:
        """The client's credit, or 0 while it has not read what was written to it
        (``DmqConnection.output_blocked``): a consumer that does not read gets no more."""
        return 0 if self.connection.blocked else self._credit

    @credit.setter
    def credit(self, value: int) -> None:
        self._credit = value

    def push_many(self, channel: ChannelRef, deliveries: Sequence[Pushed]) -> None:
        """Each copy as a CONSUMER_PUSH, queued for this reactor turn's write in one call
        (a lone consumer's credit filled by one commit or one batch of acks)."""
        connection = self.connection
        if connection.closed:
            return
        encode = connection.push_frame.parts
        name = channel.name
        parts: list[bytes] = []
        for delivery in deliveries:
            message = delivery.message
            attempts = delivery.attempts
            try:
                parts += encode(
                    message.message_id,
                    message.session_id,
                    message.producer,
                    message.topic,
                    name,
                    message.published_ms,
                    attempts if attempts < 0xFFFF else 0xFFFF,
                    message.body,
                    message.status,
                )
            except FrameError as error:  # this copy only: it stays in flight and times out
                log.error("message {id} of {topic}/{channel} cannot be pushed: {error}", id=message.message_id,
                          topic=message.topic, channel=name, error=error)
        connection.queue_parts(parts)

    def channel_closed(self, channel: ChannelRef) -> None:
        self.connection.subscriptions.pop((channel.topic, channel.name), None)


class DmqConnection:
    """Serves one client that opened with the dmq magic."""

    def __init__(self, transport: Transport, broker: BrokerPort, clock: Clock, registry: set[DmqConnection], *,
                 tls: ServerTls | None = None, authorizer: Authorizer | None = None):
        self.transport = transport
        self._write = direct_writer(transport, self._queued)  # every byte to the client, in order
        self.blocked = False  # the client does not read what it is sent: no pushes (output_blocked)
        self.broker = broker
        self.clock = clock
        options = broker.options
        self.decoder = FrameDecoder(options.max_msg_size + MIN_FRAME_SIZE + 3 * 255 + 4096 + 4)
        self._send_reply = SendReplyEncoder()  # one answer per message: no Frame built
        self.push_frame = PushEncoder()  # one push per delivery: no Frame either
        self.subscriptions: dict[tuple[str, str], DmqSubscription] = {}
        self.closed = False
        # pushes and send replies of this reactor turn; held past a stall: _stale_turn
        self._turn = TurnBuffer(clock, self._emit, getattr(broker, "may_push", None), self._stale_turn)
        self.last_heard = clock.seconds()
        self._registry = registry
        registry.add(self)
        self.peer = peer_address(transport)
        self.flow: ReadGate | NoGate = NO_GATE  # the port's ReadGate (dmq_server.protocols.flow) once attached
        self.tls = tls
        self.auth = ClientAuth(authorizer, clock, peer_host(self.peer), self.peer, self._peer_tls) if authorizer else None
        self._backlog: deque[Frame] | None = None  # frames waiting for the authorizer
        self._heartbeat = LoopingCall(self._beat)
        # IReactorTime is a zope interface, nominal to mypy; the reactor and task.Clock provide it
        self._heartbeat.clock = cast(IReactorTime, clock)
        self._heartbeat.start(options.heartbeat_interval, now=False)
        self._deadline: Timer | None = clock.callLater(2 * options.heartbeat_interval, self._check_silence)
        # the body lists what this server accepts beyond v1's first set (old clients ignore it)
        self.write(Frame(Command.SERVER_HEALTH, status="OK" if broker.healthy else broker.health_detail,
                         body=_FEATURES))

    # -- transport side ---------------------------------------------------
    def write(self, frame: Frame) -> None:
        """Written now, after what ``queue_write`` holds (the order is the client's)."""
        if not self.closed:
            self._turn.flush()
            self._emit(encode(frame))

    def queue_write(self, data: bytes) -> None:
        """Written when this reactor turn ends, with the rest of the turn's (``TurnBuffer``)."""
        if not self.closed:
            self._turn.add(data)

    def queue_parts(self, parts: Sequence[bytes]) -> None:
        """``queue_write`` of a frame in parts (``PushEncoder.parts``); the caller checked
        ``closed`` (one push per delivered copy: the hot path)."""
        self._turn.extend(parts)

    def _emit(self, data: bytes) -> None:
        if not self.closed:
            self._write(data)

    def _queued(self) -> None:
        self.flow.output_queued()

    def output_blocked(self, blocked: bool) -> None:
        """The port's gate: the client's unread bytes passed ``--max-output-buffer``
        (True), or were all sent (False: pushes go on where its credit allows)."""
        self.blocked = blocked
        if not blocked:
            for sub in list(self.subscriptions.values()):
                if sub.channel is not None and not self.closed:
                    sub.channel.pump()

    def _stale_turn(self) -> bool:
        """This turn's bytes were held while the process stood still, and the node may no
        longer push (``protocols.turn``): with copies in flight here they may carry pushes
        of copies another node has taken over, so the connection closes without them
        (its copies go back; the client connects again). None in flight: the bytes are
        answers, and go (False)."""
        if not any(sub.in_flight for sub in self.subscriptions.values()):
            return False
        self.close()
        return True

    def data_received(self, data: bytes) -> None:
        self.last_heard = self.clock.seconds()
        try:
            frames = self.decoder.feed(data)
        except FrameError as exc:
            self.protocol_error(exc.code, exc.message)
            return
        if frames:
            self.flow.frame_completed()
        if self._backlog is not None:
            self._backlog.extend(frames)
            return
        i, count = 0, len(frames)
        while i < count:
            if self.closed:
                return
            frame = frames[i]
            if frame.command in _SENDS and frame.msg_type != MessageType.DELAY:
                # a lone send too: at a paced producer's rate each read holds one, and the
                # run path costs 6 % fewer instructions a message (bench/steady_cost.py)
                end = _run_end(frames, i)
                if self.auth is None or self.auth.allows_now(PUBLISH, frame.topic):
                    self._send_run(frames[i:end])
                    i = end
                    continue
            self._dispatch(frame)
            if self._backlog is not None:
                self._backlog.extend(frames[i + 1 :])
                return
            i += 1

    def buffered(self) -> int:
        """Bytes of an incomplete frame held (the port's flow control counts them)."""
        return 0 if self.closed else self.decoder.buffered

    def timed_out(self, description: str) -> None:
        """The port's read timeout: an incomplete frame took too long."""
        self.protocol_error("E_TIMEOUT", description)

    def protocol_error(self, code: str, description: str) -> None:
        log.info("{peer}: protocol error {code} {why}", peer=self.peer, code=code, why=description)
        self.write(Frame(Command.PROTOCOL_ERROR, status=f"{code} {description}"))
        self.close()

    def close(self) -> None:
        if not self.closed:
            self._turn.flush()
            self.transport.loseConnection()
            self.flow.closing()  # aborted later if the client never reads the rest
            self.connection_lost()
            self.closed = True

    def connection_lost(self) -> None:
        if self._heartbeat.running:
            self._heartbeat.stop()
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
        self._deadline = None
        self._registry.discard(self)
        # what a partial frame held goes now, not when the collector finds this object
        self.decoder = FrameDecoder(self.decoder.max_frame_size)
        subs, self.subscriptions = self.subscriptions, {}
        for sub in subs.values():
            if sub.channel is not None:
                self.broker.unsubscribe(sub.channel, sub)
        self.closed = True

    def _beat(self) -> None:
        interval = self.broker.options.heartbeat_interval
        self.write(Frame(Command.SERVER_HEARTBEAT, credit=int(interval * 1000)))

    def _check_silence(self) -> None:
        """A timer due exactly two heartbeat intervals after the last byte heard (a
        check on the heartbeat tick would close between two and three intervals)."""
        self._deadline = None
        if self.closed:
            return
        limit = 2 * self.broker.options.heartbeat_interval
        now = self.clock.seconds()
        if self.flow.server_paused:
            self.last_heard = now  # not read because of the server: not the client's silence
        idle = now - self.last_heard
        if idle >= limit:
            log.info("{peer}: no data for two heartbeat intervals, closing", peer=self.peer)
            self.protocol_error("E_TIMEOUT", "no data received for two heartbeat intervals")
            return
        self._deadline = self.clock.callLater(limit - idle, self._check_silence)

    # -- security -----------------------------------------------------------
    def _peer_tls(self) -> PeerTls | None:
        return peer_tls(self.transport, self.tls) if ISSLTransport.providedBy(self.transport) else None

    def security_stats(self) -> dict[str, object]:
        """TLS and identity, for ``/admin/clients``."""
        tls = self._peer_tls()
        out: dict[str, object] = {"tls": tls is not None, "tls_version": tls.version if tls is not None else ""}
        if self.auth is not None:
            out.update(self.auth.stats())
        return out

    def _allowed(self, frame: Frame, verb: str, permission: str, channel: str = "") -> DmqError | None | bool:
        """True to go on, False when the frame waits for the authorizer (it runs again
        then), or the refusal to answer it with."""
        if self.auth is None:
            return True
        try:
            waiting = self.auth.check(verb, permission, frame.topic, channel)
        except AuthFailed as err:  # the authorizer refused or failed: start over
            self.protocol_error(err.code, err.description)
            return False
        except DmqError as err:
            return err
        if waiting is None:
            return True
        self._hold(waiting, lambda: self._dispatch(frame))
        return False

    def _hold(self, waiting: Deferred, then: Callable[[], None]) -> None:
        """Frames wait (in order, and the port stops reading) until ``waiting`` fires."""
        if waiting.called:
            then()
            return
        self._backlog = deque()
        self.flow.hold(AUTH)

        def resume(_: object) -> None:
            backlog, self._backlog = self._backlog, None
            if self.closed:
                return
            then()
            while backlog and not self.closed:
                if self._backlog is not None:  # held again
                    self._backlog.extend(backlog)
                    return
                self._dispatch(backlog.popleft())
            self.flow.release(AUTH)

        waiting.addCallback(resume)

    def _login(self, frame: Frame) -> None:
        if self.auth is None:
            self.protocol_error("E_AUTH_DISABLED", "AUTH disabled")
            return
        if self.auth.secret is not None:
            self.protocol_error("E_INVALID", "AUTH already set")
            return
        outcome: list[AuthState | Failure] = []
        waiting = self.auth.login(frame.body.decode("utf-8", "replace")).addBoth(outcome.append)

        def answer() -> None:
            result = outcome[0]
            if isinstance(result, Failure):
                error = result.value if isinstance(result.value, DmqError) else AuthFailed("AUTH failed")
                self.protocol_error(error.code, error.description)
            else:
                self.write(Frame(Command.AUTH_ACK, session_id=frame.session_id, status=result.reply().decode()))

        self._hold(waiting, answer)

    # -- commands ---------------------------------------------------------
    def _dispatch(self, frame: Frame) -> None:
        command = frame.command
        if command in (Command.UP_PRODUCER_SEND, Command.UP_PRODUCER_RESEND):
            self._send(frame)
        elif command == Command.UP_CONSUMER_ACKS:
            self._ack_many(frame)
        elif command == Command.UP_CONSUMER_ACK:
            self._ack(frame)
        elif command == Command.UP_CONSUMER_REQUEUE:
            self._requeue(frame)
        elif command == Command.UP_SUBSCRIBE:
            self._subscribe(frame)
        elif command == Command.UP_CREDIT:
            self._credit(frame)
        elif command == Command.UP_HEARTBEAT:
            pass
        elif command == Command.UP_AUTH:
            self._login(frame)
        else:
            self.protocol_error("E_INVALID", f"{command.name} is not a client command")

    def _ack(self, frame: Frame) -> None:
        """Acknowledge a copy pushed to *this* connection's subscription. Any other
        ack (no such subscription, a copy held by another consumer, one that timed
        out and went back to the queue) is ignored, as the protocol has no reply
        for acks, and counted in ``/stats`` (``acks_refused``)."""
        sub = self.subscriptions.get((frame.topic, frame.channel))
        if sub is None or self.broker.ack(frame.topic, frame.channel, frame.message_id, sub) is not None:
            self.broker.count_refused_acks(1)

    def _ack_many(self, frame: Frame) -> None:
        """Acknowledge each id of the body, as ``_ack`` does one: an id refused fails no
        other. One frame for a whole read of pushes is what makes a consumer's acks cheap:
        an ``UP_CONSUMER_ACK`` costs a decode and a dispatch per copy."""
        try:
            ids = unpack_ids(frame.body)
        except FrameError as exc:
            self.protocol_error(exc.code, exc.message)
            return
        sub = self.subscriptions.get((frame.topic, frame.channel))
        if sub is None:
            self.broker.count_refused_acks(len(ids))
        else:
            refused = self.broker.ack_many(frame.topic, frame.channel, ids, sub)
            if refused:
                self.broker.count_refused_acks(refused)

    def _requeue(self, frame: Frame) -> None:
        """Give a copy pushed to *this* connection's subscription back, ready again
        ``credit`` ms from now (NSQ's REQ with a delay). Unlike an ack, the consumer
        waits to hear whether it happened: a refused requeue (the copy timed out and went
        to another consumer, a delay above ``--max-req-timeout``) leaves that copy where
        it is, and the consumer must know its message was not put back as asked. Nothing
        here is fatal: the connection and its other copies go on."""
        max_ms = int(self.broker.options.max_req_timeout * 1000)
        if frame.credit > max_ms:
            error = f"E_INVALID requeue delay {frame.credit} ms is above {max_ms}"
        elif (sub := self.subscriptions.get((frame.topic, frame.channel))) is None:
            error = f"E_REQUEUE_FAILED no subscription to {frame.topic}/{frame.channel} on this connection"
        else:
            reason = self.broker.requeue(frame.topic, frame.channel, frame.message_id, sub, frame.credit / 1000)
            error = "" if reason is None else f"E_REQUEUE_FAILED {reason}"
        self.write(Frame(Command.REQUEUE_ACK, message_id=frame.message_id, topic=frame.topic,
                         channel=frame.channel, credit=frame.credit, status=error))

    def _send(self, frame: Frame) -> None:
        if self.auth is not None:  # without an authorizer every send may go (once per message: no call)
            allowed = self._allowed(frame, "send", PUBLISH)
            if allowed is not True:
                if allowed:  # a refusal: this send only
                    self.queue_write(self._send_reply(
                        Command.SEND_INVALID_ACK, frame.session_id, 0, frame.topic, frame.producer, allowed.status))
                return
        topic, producer = frame.topic, frame.producer
        send = Send(topic=topic, producer=producer, session_id=frame.session_id, body=frame.body,
                    produced_ms=frame.timestamp_ms, resend=frame.command == Command.UP_PRODUCER_RESEND)
        if frame.status and not self._read_properties(frame, send):
            return
        request = PublishRequest(topic=topic, producer=producer, sends=[send],
                                 due_ms=frame.due_ms if frame.msg_type == MessageType.DELAY else None)
        self.broker.publish(request, self._answer_send(frame))

    def _send_run(self, frames: list[Frame]) -> None:
        """Sends of one read from one producer to one topic, none delayed (``_run_end``),
        that the authorizer (if any) allows now: handed to the broker in one call
        (``Broker.publish_each``, one request holding the run) and answered together
        (``_answer_run``), each send's
        reply what ``_send`` would answer. A run the authorizer must be asked about
        again, or refuses, goes send by send, so each send waits or is refused as it
        would be alone."""
        first = frames[0]
        resend = Command.UP_PRODUCER_RESEND
        topic, producer = first.topic, first.producer
        sends = [
            new_send(topic=topic, producer=producer, session_id=frame.session_id, body=frame.body,
                     produced_ms=frame.timestamp_ms, resend=frame.command == resend)
            for frame in frames
        ]
        if any([frame.status for frame in frames]):  # properties: each read, a refused one answered alone
            kept = [(frame, send) for frame, send in zip(frames, sends)
                    if not frame.status or self._read_properties(frame, send)]
            if not kept:
                return
            frames, sends = [frame for frame, _ in kept], [send for _, send in kept]
        self.flow.sends_started(len(frames), sum([len(frame.body) for frame in frames]))
        self.broker.publish_each(
            new_request(topic=topic, producer=producer, sends=sends),
            lambda start, outcomes: self._answer_run(frames, start, outcomes),
        )

    def _read_properties(self, frame: Frame, send: Send) -> bool:
        """A send's properties (its ``status``: ``dmq_client.wire.properties``), read into
        ``send``; False when they break a rule, the send then answered ``SEND_INVALID_ACK``
        with ``E_BAD_PROPERTIES`` and the rule, and nothing else of its read refused. Strict:
        a field this server does not know is refused, since the client sent it to be kept."""
        try:
            properties = decode_properties(frame.status)
        except PropertiesError as error:
            self.queue_write(self._send_reply(
                Command.SEND_INVALID_ACK, frame.session_id, 0, frame.topic, frame.producer, error.status()))
            return False
        send.properties, send.status = properties, frame.status
        return True

    def _answer_send(self, frame: Frame) -> Callable[[Published | BaseException], None]:
        """The send counted until answered (backpressure, dmq_server.protocols.flow), and
        the ``done`` that answers it."""
        self.flow.sends_started(1, len(frame.body))
        return lambda outcome: self._answer_run((frame,), 0, (outcome,))

    def _answer_run(self, frames: Sequence[Frame], start: int, outcomes: Sequence[Published | BaseException]) -> None:
        """The replies to ``frames[start:]``'s sends, one per outcome (``Published`` or
        the ``DmqError``), queued for this turn's write together."""
        encode = self._send_reply
        replies = []
        confirming: list[tuple[Frame, int]] | None = None
        size = 0
        for frame, outcome in zip(frames[start : start + len(outcomes)], outcomes):
            size += len(frame.body)
            message_id = 0
            if isinstance(outcome, Published):
                command, message_id, status = (
                    Command.SEND_SUCCESS_ACK, outcome.message_id, "duplicate" if outcome.duplicate else "")
                if frame.credit:  # the producer asked to hear when it is consumed (§4.14)
                    if confirming is None:
                        confirming = []
                    confirming.append((frame, message_id))
            elif isinstance(outcome, DmqError):
                command, status = reply_for(outcome, _SEND_REPLY, Command.SEND_SERVER_ERROR), outcome.status
            else:
                log.error("send failed: {error!r}", error=outcome)
                command, status = Command.SEND_SERVER_ERROR, f"E_INTERNAL {outcome!r}"
            try:
                replies.append(encode(command, frame.session_id, message_id, frame.topic, frame.producer, status))
            except FrameError:  # this send's reply only (a name the frame cannot carry back)
                log.failure("the reply to send {session_id} cannot be encoded", session_id=frame.session_id)
        self.flow.sends_done(len(outcomes), size)
        if not self.closed:
            self._turn.extend(replies)
            if confirming is not None:
                self._confirm(confirming)

    def _confirm(self, sends: list[tuple[Frame, int]]) -> None:
        """Watch each stored send whose ``credit`` asked for ``SEND_CONSUMED_ACK`` (the
        deadline in ms); one that cannot be watched is answered at once, after its
        ``SEND_SUCCESS_ACK``: the message is stored and delivered all the same."""
        for frame, message_id in sends:
            deadline = frame.credit
            if frame.msg_type == MessageType.DELAY:
                error = "E_UNSUPPORTED a delayed message's consumption is not confirmed"
            elif deadline > CONFIRM_MAX_MS:
                error = f"E_INVALID confirmation deadline {deadline} ms is above {CONFIRM_MAX_MS}"
            else:
                error = self.broker.confirm_consumed(frame.topic, message_id, frame.session_id, frame.producer,
                                                     deadline, self)
            if error:
                self.consumed(frame.session_id, frame.producer, frame.topic, message_id, error)

    def consumed(self, session_id: int, producer: str, topic: str, message_id: int, status: str) -> None:
        """A watched message's outcome (``reliable.confirm``), or why it is not watched."""
        self.queue_write(encode(Frame(Command.SEND_CONSUMED_ACK, session_id=session_id, message_id=message_id,
                                      topic=topic, producer=producer, status=status)))

    def _subscribe(self, frame: Frame) -> None:
        options = self.broker.options
        credit = frame.credit or options.default_credit
        key = (frame.topic, frame.channel)

        def reply(command: Command, status: str = "") -> None:
            self.write(
                Frame(
                    command,
                    session_id=frame.session_id,
                    topic=frame.topic,
                    channel=frame.channel,
                    credit=credit,
                    status=status,
                )
            )

        if credit > options.max_credit:
            reply(Command.SUBSCRIBE_INVALID_ACK, f"E_INVALID credit {credit} above {options.max_credit}")
            return
        allowed = self._allowed(frame, "subscribe", SUBSCRIBE, frame.channel)
        if allowed is not True:
            if allowed:
                reply(Command.SUBSCRIBE_INVALID_ACK, allowed.status)
            return
        existing = self.subscriptions.get(key)
        if existing is not None:
            existing.credit = credit
            reply(Command.SUBSCRIBE_ACK, SERVER_FEATURES)  # what this server accepts beyond v1's first set
            if existing.channel is not None:
                existing.channel.pump()
            return
        sub = DmqSubscription(self, credit)
        self.subscriptions[key] = sub

        def ok(channel: PumpedChannel) -> None:
            if self.closed or self.subscriptions.get(key) is not sub:
                self.broker.unsubscribe(channel, sub)
                return
            sub.channel = channel
            reply(Command.SUBSCRIBE_ACK, SERVER_FEATURES)
            channel.pump()

        def failed(failure: Failure) -> None:
            self.subscriptions.pop(key, None)
            error = failure.value
            if isinstance(error, DmqError):
                reply(reply_for(error, _SUBSCRIBE_REPLY, Command.SUBSCRIBE_SERVER_ERROR), error.status)
            else:
                log.failure("subscribe failed", failure)
                reply(Command.SUBSCRIBE_SERVER_ERROR, f"E_INTERNAL {error!r}")

        # The reply must precede the first push, so attach with zero credit first.
        real_credit, sub.credit = credit, 0

        def restore(channel: PumpedChannel) -> PumpedChannel:
            sub.credit = real_credit
            return channel

        self.broker.subscribe(frame.topic, frame.channel, sub).addCallback(restore).addCallbacks(ok, failed)

    def _credit(self, frame: Frame) -> None:
        sub = self.subscriptions.get((frame.topic, frame.channel))
        if sub is None:
            self.protocol_error("E_INVALID", f"UP_CREDIT for {frame.topic}/{frame.channel} without a subscription")
            return
        if frame.credit > self.broker.options.max_credit:
            self.protocol_error("E_INVALID", f"credit {frame.credit} above {self.broker.options.max_credit}")
            return
        sub.credit = frame.credit
        if sub.channel is not None:
            sub.channel.pump()

    def reboot(self) -> None:
        """Graceful shutdown notice; the connection closes once sends are answered."""
        self.write(Frame(Command.SERVER_REBOOT, status="server is shutting down"))

    def health_changed(self, ok: bool) -> None:
        if ok:
            self.write(Frame(Command.SERVER_HEALTH, status="OK", body=_FEATURES))

"""The MQTT transport on paho-mqtt 2.x (MQTT v5): the broker port (port.py) of the worker.

paho runs its own network thread, which reads the socket in chunks (``_ChunkReadingClient``).
Its callbacks do no work: they hand what arrived to the event loop (``_hand_over``: in order,
one wake-up of the loop for all that comes while it is busy) and return; anything they raise
is logged and swallowed so the network loop never dies. Requests are acknowledged manually,
by the service, once they are answered (the broker redelivers what was never acknowledged).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import socket
import ssl
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import paho.mqtt.client as mqtt
from loguru import logger
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from .port import Delivery, InboundMessage, OutboundProperties, PublishNotSent, PublishRefused

if TYPE_CHECKING:
    from paho.mqtt.enums import LogLevel

    from ..config.models import WorkerConfig
    from ..protocol.topics import Topics

ONLINE = b"online"
OFFLINE = b"offline"
# Unwatched filters remembered, so that messages still on their way on them are dropped, not
# taken for requests (late ones come soon, if at all: only the latest are worth keeping).
UNWATCHED_KEPT = 64


@dataclass(frozen=True)
class MqttSettings:
    host: str
    port: int
    client_id: str
    username: str | None
    password: str | None
    keepalive: int
    reconnect_min_delay: int
    reconnect_max_delay: int
    session_expiry: int
    subscriptions: tuple[str, ...]
    status_topic: str
    # MQTT 5 Receive Maximum: the broker sends at most this many unacknowledged requests and
    # holds back the rest (requests are acknowledged once answered: these are the pending ones).
    receive_maximum: int = 65535
    # TLS: on when tls_ca_file is set (the broker's certificate must chain to it and name
    # the host); a client certificate and key when the broker authenticates by certificate.
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_insecure_skip_hostname_check: bool = False  # tests only
    # paho's DEBUG lines (a line per packet: "Received PUBLISH ...", "Sending PUBACK ..."),
    # formatted only where the worker logs at DEBUG (see _ChunkReadingClient._easy_log).
    packet_log: bool = True

    @classmethod
    def from_config(cls, config: WorkerConfig, topics: Topics, worker_id: str) -> MqttSettings:
        """The worker's connection: its [mqtt] section, with what follows from the rest of
        the configuration (the topics it subscribes to, its status topic, Receive Maximum
        as its pending-request limit)."""
        mqtt = config.mqtt
        return cls(
            host=mqtt.host,
            port=mqtt.port,
            client_id=worker_id,
            username=mqtt.username,
            password=config.mqtt_password(),
            keepalive=mqtt.keepalive,
            reconnect_min_delay=mqtt.reconnect_min_delay,
            reconnect_max_delay=mqtt.reconnect_max_delay,
            session_expiry=mqtt.session_expiry,
            subscriptions=tuple(topics.subscriptions(mqtt.share_group)),
            status_topic=topics.status(worker_id),
            receive_maximum=config.limits.max_pending_requests,
            tls_ca_file=mqtt.tls_ca_file,
            tls_cert_file=mqtt.tls_cert_file,
            tls_key_file=mqtt.tls_key_file,
            tls_insecure_skip_hostname_check=mqtt.tls_insecure_skip_hostname_check,
            packet_log=config.logging.level in ("DEBUG", "TRACE"),
        )


def publish_packet_size(topic: str, payload_size: int, qos: int, properties_size: int) -> int:
    """Bytes of an MQTT 5 PUBLISH packet, as paho builds it: fixed header (type byte and the
    variable-length remaining length), topic with its length, packet id (QoS > 0), properties
    (with their length prefix), payload."""
    remaining = 2 + len(topic.encode()) + (2 if qos > 0 else 0) + properties_size + payload_size
    length_bytes = 1
    while remaining >= 128**length_bytes and length_bytes < 4:
        length_bytes += 1
    return 1 + length_bytes + remaining


def _publish_properties(correlation_data: bytes | None) -> Properties | None:
    if correlation_data is None:
        return None
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.CorrelationData = correlation_data
    return props


def outbound_properties(properties: OutboundProperties | None) -> Properties | None:
    """paho's PUBLISH properties for a message to a device or an MCP server (None: none set)."""
    if properties is None:
        return None
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    if properties.response_topic is not None:
        props.ResponseTopic = properties.response_topic
    if properties.correlation_data is not None:
        props.CorrelationData = properties.correlation_data
    if properties.message_expiry is not None:
        props.MessageExpiryInterval = properties.message_expiry
    if properties.user_properties:
        props.UserProperty = list(properties.user_properties)
    if properties.content_type is not None:
        props.ContentType = properties.content_type
    return props if props.pack() != b"\x00" else None  # type: ignore[no-untyped-call]


def _content_type(props: Properties | None) -> str | None:
    value = getattr(props, "ContentType", None) if props else None
    return str(value) if value else None


def _matchable(topic_filter: str) -> str:
    """The filter a shared subscription ($share/<group>/<filter>) matches topics with."""
    if topic_filter.startswith("$share/"):
        parts = topic_filter.split("/", 2)
        return parts[2] if len(parts) == 3 else topic_filter
    return topic_filter


def _watch_options(qos: int, retain_as_published: bool = True) -> SubscribeOptions:
    """A watched filter's subscription: Retain As Published, so that a Delivery's ``retain``
    is the publisher's flag on live messages too (the broker clears it by default), and a
    device answer published retained is recognised (tools/mqtt.py refuses it). Without it
    (vision topics), ``retain`` marks only what the broker held when the filter was subscribed."""
    return SubscribeOptions(qos=qos, retainAsPublished=retain_as_published)  # type: ignore[no-untyped-call]


@dataclass(frozen=True)
class _Watch:
    """A watched topic filter (Messaging.watch): its handler runs on the event loop."""

    topic_filter: str
    handler: Callable[[Delivery], None]
    qos: int
    retain_as_published: bool = True


def set_tcp_nodelay(client: mqtt.Client) -> None:
    """Disable Nagle's algorithm on the client's socket. A reply and an acknowledgement are
    small writes back to back; with Nagle the second waits for the peer's delayed ACK
    (~40 ms on Linux). Measured on loopback: 88 ms per request/reply round trip with Nagle
    on both the broker and the clients, 0.5 ms with it off on both (see docs/protocol.md)."""
    sock = client.socket()
    if isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class ConnectionSettings(Protocol):
    """What a client needs to log in: the worker's MqttSettings and the chat client's settings."""

    @property
    def username(self) -> str | None: ...
    @property
    def password(self) -> str | None: ...
    @property
    def tls_ca_file(self) -> Path | None: ...
    @property
    def tls_cert_file(self) -> Path | None: ...
    @property
    def tls_key_file(self) -> Path | None: ...
    @property
    def tls_insecure_skip_hostname_check(self) -> bool: ...


def use_credentials_and_tls(client: mqtt.Client, settings: ConnectionSettings) -> None:
    """Username and password, and TLS when a CA is given: the broker's certificate must chain
    to it and (unless the test-only override is on) name the host."""
    if settings.username is not None:
        client.username_pw_set(settings.username, settings.password)
    if settings.tls_ca_file is not None:
        client.tls_set(
            ca_certs=str(settings.tls_ca_file),
            certfile=str(settings.tls_cert_file) if settings.tls_cert_file else None,
            keyfile=str(settings.tls_key_file) if settings.tls_key_file else None,
            cert_reqs=ssl.CERT_REQUIRED,
            tls_version=ssl.PROTOCOL_TLS_CLIENT,
        )
        client.tls_insecure_set(settings.tls_insecure_skip_hostname_check)


class BrokerUnavailable(Exception):
    """The broker cannot be used, in plain words. ``transient``: waiting may help (nothing
    listens yet, the host is unreachable, the broker is busy); otherwise the configuration
    must change (credentials, TLS, protocol)."""

    def __init__(self, problem: str, *, transient: bool) -> None:
        super().__init__(problem)
        self.problem = problem
        self.transient = transient


# CONNACK reason codes that waiting can cure (MQTT 5, 3.2.2.2); every other refusal needs a
# change of configuration on one side.
_TRANSIENT_REFUSALS = {0x88, 0x89, 0x97, 0x9F}  # server unavailable, busy, quota exceeded, rate
_REFUSAL_HINTS = {
    0x84: "the broker does not speak MQTT 5 (mosquitto 1.6 or newer does)",
    0x85: "the broker does not accept the client id (mqtt.worker_id)",
    0x86: "check mqtt.username and the password (mqtt.password_file or WORKER_MQTT_PASSWORD)",
    # mosquitto 2.0 answers a wrong password with this one too.
    0x87: "check mqtt.username and the password (mqtt.password_file or WORKER_MQTT_PASSWORD), "
    "and that the broker lets this user connect",
    0x8A: "the broker has banned this client",
}


def _socket_problem(exc: BaseException, host: str, port: int, timeout: float) -> BrokerUnavailable:
    """Plain words for an exception of the TCP or TLS connection to the broker."""
    where = f"{host}:{port}"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return BrokerUnavailable(
            f"TLS: the broker's certificate at {where} is not accepted ({exc.verify_message}); check "
            "mqtt.tls_ca_file and that the host name is one the certificate names",
            transient=False,
        )
    if isinstance(exc, ssl.SSLError):
        return BrokerUnavailable(
            f"TLS handshake with {where} failed ({exc.reason or exc}); is {port} the broker's TLS port, "
            "and does it need a client certificate (mqtt.tls_cert_file)?",
            transient=False,
        )
    if isinstance(exc, socket.gaierror):
        return BrokerUnavailable(f"cannot resolve the broker's host name {host!r} ({exc.strerror})", transient=True)
    if isinstance(exc, ConnectionRefusedError):
        return BrokerUnavailable(
            f"connection to {where} refused: no broker listens there (is it running? is mqtt.port right?)",
            transient=True,
        )
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return BrokerUnavailable(
            f"no answer from {where} within {timeout:g} s (host down, or a firewall drops the connection)",
            transient=True,
        )
    if isinstance(exc, OSError) and exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EHOSTDOWN):
        return BrokerUnavailable(f"{where} is unreachable ({exc.strerror})", transient=True)
    if isinstance(exc, OSError) and exc.strerror:
        return BrokerUnavailable(f"cannot connect to {where}: {exc.strerror}", transient=True)
    return BrokerUnavailable(f"cannot connect to {where}: {exc}", transient=True)


def check_broker(settings: MqttSettings, timeout: float = 10.0) -> None:
    """Log in to the broker once, with the worker's credentials and TLS, and log out; raise
    BrokerUnavailable saying why not. Run before the model load, which takes minutes: a broker
    that is down or refuses the login is found at once. The check uses a client id of its own
    (``<worker id>-check``) and a clean, non-persistent session, so it neither takes over nor
    resumes the worker's session (which would have the broker send it queued requests)."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{settings.client_id}-check", protocol=mqtt.MQTTv5)
    client.connect_timeout = timeout
    use_credentials_and_tls(client, settings)
    answer: list[ReasonCode] = []
    socket_errors: list[str] = []

    def on_connect(c: mqtt.Client, u: Any, flags: Any, reason: ReasonCode, props: Properties | None) -> None:
        answer.append(reason)

    def on_log(c: mqtt.Client, u: Any, level: int, text: str) -> None:
        if level == mqtt.MQTT_LOG_ERR:
            socket_errors.append(text)

    client.on_connect = on_connect
    client.on_log = on_log
    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    props.SessionExpiryInterval = 0
    where = f"{settings.host}:{settings.port}"
    try:
        client.connect(settings.host, settings.port, settings.keepalive, clean_start=True, properties=props)
    except (OSError, ValueError) as exc:  # ssl.SSLError and socket errors are OSErrors
        raise _socket_problem(exc, settings.host, settings.port, timeout) from None
    try:
        deadline = time.monotonic() + timeout
        lost = False
        while not answer and time.monotonic() < deadline:
            if client.loop(0.1) != mqtt.MQTT_ERR_SUCCESS:
                lost = True
                break
        if not answer:
            said = "; ".join(
                e.removeprefix("failed to receive on socket: ")
                for e in socket_errors
                if not e.startswith("Client is not connected")
            )
            if lost and settings.tls_ca_file is not None:
                # Under TLS 1.3 a broker that wants a client certificate (or does not trust
                # this one) ends the connection after the handshake: the alert, or an EOF.
                raise BrokerUnavailable(
                    f"{where} ended the TLS connection before the login ({said}): does it need a client certificate "
                    "(mqtt.tls_cert_file, mqtt.tls_key_file), and is this one signed by a CA it trusts?",
                    transient=False,
                )
            if lost:
                raise BrokerUnavailable(
                    f"{where} closed the connection without answering the login"
                    + (f" ({said})" if said else "")
                    + (
                        ": is it an MQTT broker, or a TLS port (then set mqtt.tls_ca_file)?"
                        if settings.tls_ca_file is None
                        else ""
                    ),
                    transient=True,
                )
            raise BrokerUnavailable(
                f"{where} accepted the connection but did not answer the login within {timeout:g} s "
                "(is it an MQTT broker? a TLS port without mqtt.tls_ca_file?)",
                transient=True,
            )
        reason = answer[0]
        if reason.is_failure:
            hint = _REFUSAL_HINTS.get(reason.value)
            raise BrokerUnavailable(
                f"the broker at {where} refused the login: {reason}" + (f"; {hint}" if hint else ""),
                transient=reason.value in _TRANSIENT_REFUSALS,
            )
        client.disconnect()
        client.loop(0.1)  # sends the DISCONNECT
    finally:
        sock = client.socket()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


READ_CHUNK = 65536


class _ChunkReadingClient(mqtt.Client):
    """paho's client, reading its socket in chunks of up to READ_CHUNK bytes.

    paho reads a packet a few bytes at a time (its type, each byte of its length, then its
    body): a system call each, and each gives up the GIL, which paho's thread must then take
    back from the event loop's. While the loop is busy (a burst's tokens streaming) every such
    read waits up to the interpreter's switch interval (5 ms). Measured on 2 cores, 1,000
    requests published at once, a thread busy in Python beside paho's: all received after
    26.8 s with paho's reads, 0.66 s read in chunks (0.13 and 0.08 s beside an idle thread).
    paho parses the packets as before, from this buffer."""

    def __init__(self, *args: Any, packet_log: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_buffer = bytearray()
        self._packet_log = packet_log

    def _easy_log(self, level: LogLevel, fmt: str, *args: Any) -> None:
        # paho formats every packet's DEBUG line (its properties too) before anyone can drop
        # it: 11 us a line on 2 cores, four lines a request and one a stream delta, on the event
        # loop's thread for what the worker publishes. Not formatted where nobody reads it.
        if level == mqtt.MQTT_LOG_DEBUG and not self._packet_log:
            return
        super()._easy_log(level, fmt, *args)

    def _sock_recv(self, bufsize: int) -> bytes:
        buffer = self._read_buffer
        if not buffer:
            chunk: bytes = super()._sock_recv(max(bufsize, READ_CHUNK))  # raises BlockingIOError for none
            if len(chunk) <= bufsize:
                return chunk  # all of it wanted (b"": the broker closed the connection)
            buffer += chunk
        data = bytes(buffer[:bufsize])
        del buffer[:bufsize]
        return data

    def loop_read(self, max_packets: int = 1) -> MQTTErrorCode:
        rc = super().loop_read(max_packets)
        # The packets already in the buffer are read now: select() does not wake for them.
        while rc == MQTTErrorCode.MQTT_ERR_SUCCESS and self._read_buffer and self._sock is not None:
            rc = self._packet_read()
            if rc == MQTTErrorCode.MQTT_ERR_AGAIN:  # a packet's start: its rest is on its way
                return MQTTErrorCode.MQTT_ERR_SUCCESS
            if rc > 0:
                return self._loop_rc_handle(rc)  # type: ignore[no-any-return]
        return rc

    def _sock_close(self) -> None:
        self._read_buffer.clear()  # a new connection starts with its own bytes
        super()._sock_close()


class MqttTransport:
    def __init__(self, settings: MqttSettings, loop: asyncio.AbstractEventLoop) -> None:
        self.settings = settings
        self.inbox: asyncio.Queue[InboundMessage] = asyncio.Queue()
        self._loop = loop
        self._connected = asyncio.Event()
        # Set once the broker has acknowledged every subscription (SUBACK): only then is a
        # published request delivered to us. Stays set: a resumed session keeps them.
        self._subscribed = asyncio.Event()
        self._subscribe_mid: int | None = None
        self._unsubscribed = False  # by unsubscribe(): no resubscribing on a reconnect either
        # The broker's Maximum Packet Size from the last CONNACK (None: no limit). paho ignores
        # it, and a larger packet makes the broker disconnect us; paho then reconnects and sends
        # it again, forever. So publish() never hands paho a packet over it.
        self.max_packet_size: int | None = None
        # Counts the broker sessions: one more each time a CONNACK says ours was not resumed.
        self._session = 0
        # QoS 1 publishes not yet acknowledged by the broker, by packet id: their futures.
        self._unconfirmed: dict[int, asyncio.Future[None]] = {}
        # Watched filters (Messaging.watch: device responses, MCP over MQTT), owned by the
        # event loop. paho's thread reads only the tuples, replaced whole on each change: it
        # picks the watchers of a message and resubscribes them after every reconnect.
        self._watches: dict[str, _Watch] = {}
        self._watch_list: tuple[_Watch, ...] = ()
        # Filters unwatched while messages on them may still be on their way (or, when no
        # connection took the UNSUBSCRIBE, in the broker's session): such messages are
        # acknowledged and dropped, never taken for requests; unsubscribed again on connect.
        self._unwatched: tuple[str, ...] = ()
        # watch()'s SUBSCRIBE packets waiting for their SUBACK, by packet id.
        self._watch_acks: dict[int, asyncio.Future[None]] = {}
        # What paho's thread hands to the loop (_hand_over), in order, and whether the loop has
        # been woken for it.
        self._handed: collections.deque[tuple[Callable[..., object], tuple[object, ...]]] = collections.deque()
        self._take_scheduled = False
        client = _ChunkReadingClient(
            CallbackAPIVersion.VERSION2,
            client_id=settings.client_id,
            protocol=mqtt.MQTTv5,
            manual_ack=True,
            packet_log=settings.packet_log,
        )
        client.suppress_exceptions = True
        use_credentials_and_tls(client, settings)
        if settings.tls_ca_file is not None and settings.tls_insecure_skip_hostname_check:
            logger.warning("MQTT TLS: the broker's host name is not checked (tls_insecure_skip_hostname_check)")
        client.will_set(settings.status_topic, OFFLINE, qos=1, retain=True)
        client.reconnect_delay_set(settings.reconnect_min_delay, settings.reconnect_max_delay)
        client.on_log = self._on_log  # paho's log lines, in plain words (not paho's logging)
        self._paho_logging = True
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_subscribe = self._on_subscribe
        client.on_publish = self._on_publish
        self._client = client

    # -- paho network thread: hand over and return --------------------------------------

    def _hand_over(self, callback: Callable[..., object], *args: object) -> None:
        """Run ``callback(*args)`` on the event loop, after everything handed over before it.

        The loop is woken once for what comes while it is busy, not once per message: each
        wake-up is a write to its socket, a system call that gives up the GIL, and paho's
        thread then waits to take it back from the busy loop (up to the switch interval, 5 ms)
        before it reads the next message."""
        self._handed.append((callback, args))
        if not self._take_scheduled:
            self._take_scheduled = True
            try:
                self._loop.call_soon_threadsafe(self._take_handed)
            except RuntimeError:  # the loop is closed: nobody takes it
                self._take_scheduled = False
                raise

    def _take_handed(self) -> None:
        """On the loop: what paho's thread handed over, in order."""
        self._take_scheduled = False  # first: what comes from now on wakes the loop again
        handed = self._handed
        while handed:
            callback, args = handed.popleft()
            try:
                callback(*args)
            except Exception:  # one must not keep the rest from the loop
                logger.exception("error taking over an MQTT event")

    def _on_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: ReasonCode, properties: Properties | None
    ) -> None:
        try:
            if reason.is_failure:
                hint = _REFUSAL_HINTS.get(reason.value)
                level = "WARNING" if reason.value in _TRANSIENT_REFUSALS else "ERROR"
                logger.log(level, "MQTT connect refused: {}{}; retrying", reason, f" ({hint})" if hint else "")
                return
            set_tcp_nodelay(client)
            resumed = bool(getattr(flags, "session_present", False))
            if not resumed:
                # The broker lost our session (restarted without persisting it, or it
                # expired): it numbers its messages from scratch, so a packet id of a message
                # from before now names another message. Acknowledging the old one would
                # acknowledge the new one, unanswered. Messages of this connection carry the
                # new number, and ack() drops acknowledgements of earlier sessions.
                self._session += 1
            limit = getattr(properties, "MaximumPacketSize", None) if properties is not None else None
            self.max_packet_size = int(limit) if limit else None
            # Subscribing here (not in the loop) makes every reconnect resubscribe at once.
            if not self._unsubscribed:
                # Retain As Published: the broker keeps the retain flag of a live delivery as the
                # publisher set it (it clears it by default), so a retained request is
                # recognised and ignored while the worker is online too, not only at
                # subscribe time. It works for MQTT 3.1.1 publishers as well: the flag is
                # the publisher's, the option is this subscription's.
                options = SubscribeOptions(qos=1, retainAsPublished=True)  # type: ignore[no-untyped-call]
                _, self._subscribe_mid = client.subscribe([(topic, options) for topic in self.settings.subscriptions])
            # Watched filters in a SUBSCRIBE of their own (its SUBACK is not the requests'):
            # also after unsubscribe(), as a draining worker's tool calls still want answers.
            watches = self._watch_list
            if watches:
                client.subscribe([(w.topic_filter, _watch_options(w.qos, w.retain_as_published)) for w in watches])
            if self._unwatched:
                client.unsubscribe(list(self._unwatched))
            client.publish(self.settings.status_topic, ONLINE, qos=1, retain=True)
            logger.info(
                "MQTT connected to {}:{} (session {})",
                self.settings.host,
                self.settings.port,
                "resumed" if resumed else "new",
            )
            self._hand_over(self._connected.set)
        except Exception:  # never let a callback kill paho's network loop
            logger.exception("error in MQTT connect callback")

    def _on_log(self, client: mqtt.Client, userdata: Any, level: int, text: str) -> None:
        """paho's own log lines. Its ERRORs while the broker is away are the connection's state,
        already told in plain words by _on_connect_fail and _on_disconnect: "Client is not
        connected. Socket: None). Last known Connection State: ..." (each failed reconnect) is
        left at DEBUG, a lost socket becomes a WARNING. paho's other ERRORs (an exception in a
        callback) stay ERRORs."""
        try:
            if not self._paho_logging:
                return
            name = logger.bind(name="paho.mqtt.client")
            if level == mqtt.MQTT_LOG_ERR:
                if text.startswith("Client is not connected"):
                    name.debug(text)
                elif text.startswith(("failed to receive on socket: ", "timeout on socket: ")):
                    name.warning(
                        "MQTT connection to {}:{} lost: {}",
                        self.settings.host,
                        self.settings.port,
                        text.split(": ", 1)[1],
                    )
                else:
                    name.error(text)
            elif level == mqtt.MQTT_LOG_WARNING:
                name.warning(text)
            elif level in (mqtt.MQTT_LOG_INFO, mqtt.MQTT_LOG_NOTICE):
                name.info(text)
            else:
                name.debug(text)
        except Exception:  # logging must never kill paho's network loop
            pass

    def _on_connect_fail(self, client: mqtt.Client, userdata: Any) -> None:
        # paho calls this inside its ``except OSError`` around the connection attempt and
        # passes no error: the one being handled is why (refused, unreachable, TLS failures
        # such as "certificate verify failed"). paho retries with backoff.
        try:
            error = sys.exc_info()[1]
            logger.warning(
                "MQTT connection to {}:{} failed: {}; retrying",
                self.settings.host,
                self.settings.port,
                error if error is not None else "unknown error",
            )
        except Exception:
            logger.exception("error in MQTT connect-fail callback")

    def _on_disconnect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: ReasonCode, properties: Properties | None
    ) -> None:
        try:
            self._hand_over(self._connected.clear)
            self._hand_over(self._watch_acks_lost)
            if reason.value != 0:
                logger.warning("MQTT disconnected ({}); reconnecting", reason)
        except Exception:
            logger.exception("error in MQTT disconnect callback")

    def _on_publish(
        self, client: mqtt.Client, userdata: Any, mid: int, reason: ReasonCode, properties: Properties | None
    ) -> None:
        try:
            refused = str(reason) if reason.is_failure else None  # e.g. not authorized: never delivered
            if refused is not None:
                logger.warning("MQTT publish {} refused by the broker: {}", mid, refused)
            self._hand_over(self._confirmed, mid, refused)
        except Exception:
            logger.exception("error in MQTT publish callback")

    def _on_subscribe(
        self, client: mqtt.Client, userdata: Any, mid: int, reasons: list[ReasonCode], properties: Properties | None
    ) -> None:
        try:
            refused = [r for r in reasons if r.is_failure]
            if refused:
                logger.error("MQTT subscription refused: {}", ", ".join(str(r) for r in refused))
            elif mid == self._subscribe_mid:
                self._hand_over(self._subscribed.set)
            # A watch() waiting for this SUBACK learns its answer on the loop (its packet id is
            # registered there before this report can run).
            self._hand_over(self._watch_answered, mid, ", ".join(str(r) for r in refused) if refused else None)
        except Exception:
            logger.exception("error in MQTT subscribe callback")

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        if self._watched_message(client, message):
            return
        try:
            props = message.properties
            response_topic = getattr(props, "ResponseTopic", None) if props else None
            correlation = getattr(props, "CorrelationData", None) if props else None
            expiry = getattr(props, "MessageExpiryInterval", None) if props else None
            received = time.monotonic()
            inbound = InboundMessage(
                topic=message.topic,
                payload=bytes(message.payload),
                qos=message.qos,
                mid=message.mid,
                retain=bool(message.retain),
                response_topic=response_topic,
                correlation_data=bytes(correlation) if correlation is not None else None,
                received_at=received,
                expires_at=received + expiry if expiry is not None else None,
                session=self._session,
                dup=bool(message.dup),
            )
            self._hand_over(self.inbox.put_nowait, inbound)
        except Exception:
            logger.exception("error in MQTT message callback on message {}", getattr(message, "mid", "?"))
            self._hand_over_bare(client, message)

    def _watched_message(self, client: mqtt.Client, message: mqtt.MQTTMessage) -> bool:
        """A message on a watched (or just unwatched) filter: acknowledged at once, here, as no
        request is answered by it and the service never sees it (a Receive Maximum slot
        must not wait for it), then handed to its watchers on the loop. False: not one,
        a request (or control) for the service, untouched."""
        try:
            topic = message.topic
            watchers = [w for w in self._watch_list if mqtt.topic_matches_sub(_matchable(w.topic_filter), topic)]
            stale = not watchers and any(mqtt.topic_matches_sub(_matchable(f), topic) for f in self._unwatched)
        except Exception:  # not readable as a watched message: the request path (and its checks) takes it
            logger.exception("error matching MQTT message {} against the watched topics", getattr(message, "mid", "?"))
            return False
        if not watchers and not stale:
            return False
        try:
            if message.qos > 0:
                client.ack(message.mid, message.qos)
            if stale:
                logger.debug("Dropping a message on {}, no longer watched", topic)
            else:
                self._hand_to_watchers(watchers, message)
        except Exception:  # never let a callback kill paho's network loop
            logger.exception("error handing over watched MQTT message {}", getattr(message, "mid", "?"))
        return True

    def _hand_to_watchers(self, watchers: list[_Watch], message: mqtt.MQTTMessage) -> None:
        topic = message.topic
        props = message.properties
        correlation = getattr(props, "CorrelationData", None) if props else None
        user_properties = getattr(props, "UserProperty", None) if props else None
        delivery = Delivery(
            topic=topic,
            payload=bytes(message.payload),
            retain=bool(message.retain),
            correlation_data=bytes(correlation) if correlation is not None else None,
            response_topic=getattr(props, "ResponseTopic", None) if props else None,
            user_properties=tuple((str(k), str(v)) for k, v in user_properties or ()),
            content_type=_content_type(props),
            received_at=time.monotonic(),
        )
        for watch in watchers:
            self._hand_over(self._deliver, watch, delivery)

    @staticmethod
    def _deliver(watch: _Watch, delivery: Delivery) -> None:
        try:
            watch.handler(delivery)
        except Exception:  # one watcher's bug must not stop the loop's other work
            logger.exception("Handler of watched topic {} failed", watch.topic_filter)

    def _hand_over_bare(self, client: mqtt.Client, message: mqtt.MQTTMessage) -> None:
        """A message whose properties could not be read is handed over without them, so the
        service still answers it. Only if not even that can be built is it acknowledged here
        (with the error above): left unacknowledged it would hold one of the Receive Maximum
        slots until the next reconnect, and then fail the same way; with a small Receive
        Maximum the worker would receive nothing more (docs/reliability.md)."""
        try:
            bare = InboundMessage(
                topic=str(message.topic),
                payload=bytes(message.payload),
                qos=int(message.qos),
                mid=int(message.mid),
                retain=bool(message.retain),
                response_topic=None,
                correlation_data=None,
                received_at=time.monotonic(),
                session=self._session,
                dup=bool(message.dup),
            )
            self._hand_over(self.inbox.put_nowait, bare)
        except Exception:
            logger.exception("MQTT message {} cannot be handed over at all: acknowledged unanswered", message.mid)
            try:
                if message.qos > 0:
                    client.ack(message.mid, message.qos)
            except Exception:
                logger.exception("could not acknowledge the dropped message")

    # -- event loop side ----------------------------------------------------------------

    def start(self) -> None:
        """Connect in the background; paho retries with backoff until the broker answers."""
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = self.settings.session_expiry
        props.ReceiveMaximum = max(1, min(self.settings.receive_maximum, 65535))
        self._client.connect_async(
            self.settings.host, self.settings.port, self.settings.keepalive, clean_start=False, properties=props
        )
        self._client.loop_start()

    async def wait_connected(self) -> None:
        await self._connected.wait()

    async def wait_subscribed(self) -> None:
        """Until the broker has acknowledged the subscriptions."""
        await self._subscribed.wait()

    @property
    def loop_alive(self) -> bool:
        """Whether paho's network thread runs: connected, or reconnecting by itself. It ends
        only by close() or an exception that escaped a callback."""
        thread = getattr(self._client, "_thread", None)  # paho keeps loop_start's thread here
        return thread is not None and bool(thread.is_alive())

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def payload_limit(self, topic: str, *, qos: int = 1, correlation_data: bytes | None = None) -> int | None:
        """The largest payload a publish to topic can carry under the broker's Maximum Packet
        Size (possibly negative: nothing fits); None when the broker set no limit."""
        return self._payload_limit(topic, qos, _publish_properties(correlation_data))

    def _payload_limit(self, topic: str, qos: int, props: Properties | None) -> int | None:
        limit = self.max_packet_size
        if limit is None:
            return None
        properties_size = len(props.pack()) if props is not None else 1  # type: ignore[no-untyped-call]
        payload = limit - publish_packet_size(topic, 0, qos, properties_size)
        # The remaining length's own size grows with the payload (1 to 4 bytes).
        while payload > 0 and publish_packet_size(topic, payload, qos, properties_size) > limit:
            payload -= 1
        return payload

    def publish(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, correlation_data: bytes | None = None
    ) -> asyncio.Future[None]:
        """Queue a publish; paho sends it now or after a reconnect (QoS 1 is kept in flight).
        QoS 1: the future completes when the broker has taken it (its PUBACK), and fails with
        PublishRefused when the broker refused it or it is over payload_limit() (callers that
        can make a smaller one, replies and stream deltas, check the limit first), or with
        PublishNotSent when paho could not queue it or the client closed before the PUBACK.
        QoS 0 is best effort: done once handed to paho, whatever became of it."""
        return self._publish(topic, payload, qos, retain, _publish_properties(correlation_data))

    def send(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        properties: OutboundProperties | None = None,
    ) -> asyncio.Future[None]:
        """Messaging.send: publish() with MQTT 5 properties (ResponseTopic, CorrelationData,
        Message Expiry Interval, user properties, Content Type), the same confirmation."""
        return self._publish(topic, payload, qos, retain, outbound_properties(properties))

    def _publish(
        self, topic: str, payload: bytes, qos: int, retain: bool, props: Properties | None
    ) -> asyncio.Future[None]:
        done: asyncio.Future[None] = self._loop.create_future()
        limit = self._payload_limit(topic, qos, props)
        if limit is not None and len(payload) > limit:
            logger.error(
                "Not publishing {} bytes: over the broker's maximum packet size of {} bytes", len(payload), limit
            )
            self._settle(done, qos, PublishRefused(f"{len(payload)} bytes are over the broker's maximum packet size"))
            return done
        info = self._client.publish(topic, payload, qos=qos, retain=retain, properties=props)
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            logger.warning("MQTT publish failed: {}", mqtt.error_string(info.rc))
            self._settle(done, qos, PublishNotSent(mqtt.error_string(info.rc)))
        elif qos == 0:
            done.set_result(None)
        else:
            # Registered before on_publish can report it: that report is handed to this loop,
            # which runs it only after this method has returned.
            self._unconfirmed[info.mid] = done
        return done

    @staticmethod
    def _settle(done: asyncio.Future[None], qos: int, failure: Exception) -> None:
        if qos == 0:
            done.set_result(None)  # best effort: nobody waits on a QoS 0 publish's fate
        else:
            done.set_exception(failure)

    def _confirmed(self, mid: int, refused: str | None) -> None:
        done = self._unconfirmed.pop(mid, None)
        if done is None or done.done():
            return
        if refused is None:
            done.set_result(None)
        else:
            done.set_exception(PublishRefused(f"refused by the broker: {refused}"))

    def ack(self, message: InboundMessage) -> None:
        if message.qos == 0:
            return
        if message.session != self._session:
            # Its session is gone, and with it the broker's copy: nothing to acknowledge.
            logger.debug("Not acknowledging message {} of a lost broker session", message.mid)
            return
        self._client.ack(message.mid, message.qos)

    async def watch(
        self,
        topic_filter: str,
        handler: Callable[[Delivery], None],
        *,
        qos: int = 1,
        retain_as_published: bool = True,
    ) -> None:
        """Messaging.watch. The filter is remembered before the SUBSCRIBE goes out, so every
        reconnect subscribes it again (a resumed session has it anyway). Refused (the ACL): it
        is forgotten and PublishRefused raised. No connection now: PublishNotSent, but it
        stays watched and is subscribed once the client is connected again."""
        self._watches[topic_filter] = _Watch(topic_filter, handler, qos, retain_as_published)
        self._watch_list = tuple(self._watches.values())
        self._unwatched = tuple(f for f in self._unwatched if f != topic_filter)
        rc, mid = self._client.subscribe([(topic_filter, _watch_options(qos, retain_as_published))])
        if rc != mqtt.MQTT_ERR_SUCCESS or mid is None:
            raise PublishNotSent(f"not subscribed now ({mqtt.error_string(rc)}); subscribed on the next connect")
        answered: asyncio.Future[None] = self._loop.create_future()
        self._watch_acks[mid] = answered
        try:
            await answered
        except PublishRefused:
            # Refused now, refused after every reconnect: not watched (unless watched anew meanwhile).
            current = self._watches.get(topic_filter)
            if current is not None and current.handler is handler:
                del self._watches[topic_filter]
                self._watch_list = tuple(self._watches.values())
            raise
        finally:
            self._watch_acks.pop(mid, None)

    def _watch_answered(self, mid: int, refused: str | None) -> None:
        answered = self._watch_acks.pop(mid, None)
        if answered is None or answered.done():
            return
        if refused is None:
            answered.set_result(None)
        else:
            answered.set_exception(PublishRefused(f"subscription refused by the broker: {refused}"))

    def _watch_acks_lost(self) -> None:
        """The connection is gone: a SUBACK still awaited will not come (the filter stays
        watched; the next connect subscribes it)."""
        for answered in self._watch_acks.values():
            if not answered.done():
                answered.set_exception(PublishNotSent("the connection was lost before the broker answered"))
        self._watch_acks.clear()

    def unwatch(self, topic_filter: str) -> None:
        """Messaging.unwatch: unsubscribe. Messages on it that are still on their way are
        acknowledged and dropped."""
        if self._watches.pop(topic_filter, None) is None:
            return
        self._watch_list = tuple(self._watches.values())
        self._unwatched = (*self._unwatched, topic_filter)[-UNWATCHED_KEPT:]
        self._client.unsubscribe(topic_filter)

    def unsubscribe(self) -> None:
        """Ask the broker to send nothing more (a share group's member that stops: the group's
        other members get its share; what is already on its way still arrives)."""
        self._unsubscribed = True
        self._client.unsubscribe(list(self.settings.subscriptions))

    async def close(self, timeout: float = 5.0) -> None:
        """Publish the retained offline status, wait for it, and disconnect."""
        info = self._client.publish(self.settings.status_topic, OFFLINE, qos=1, retain=True)
        if self.connected:
            deadline = time.monotonic() + timeout
            while not info.is_published() and time.monotonic() < deadline and self.connected:
                await asyncio.sleep(0.02)
        # paho's network thread logs an ERROR for the closed socket on its way out: not one.
        self._paho_logging = False
        self._client.disconnect()
        await asyncio.to_thread(self._client.loop_stop)
        # Whatever is still waiting for a PUBACK will not get one from this client.
        for done in self._unconfirmed.values():
            if not done.done():
                done.set_exception(PublishNotSent("the MQTT client closed before the broker took it"))
        self._unconfirmed.clear()
        for answered in self._watch_acks.values():
            if not answered.done():
                answered.set_exception(PublishNotSent("the MQTT client closed before the broker answered"))
        self._watch_acks.clear()

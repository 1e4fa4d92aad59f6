"""MCP servers discovered on the broker, as worker tools (``[tools.mcp_mqtt]``): EMQX's "MCP
over MQTT" (https://docs.emqx.com/en/emqx/latest/emqx-ai/mcp-over-mqtt/specification.html),
the client side, on the worker's one broker connection through the Messaging port only (no
paho, no MCP SDK: the JSON-RPC messages are few and plain). What it offers of a server's tool
list is decided as for [[tools.mcp]] (offer.ToolOffer: allow, the checks, the names).

Why not the official SDK's ClientSession over memory streams fed by the RPC topic, as the
stdio and HTTP servers use it (mcp.py): it is slower, measured. ``python -m bench.mcp_mqtt``
(1,000 calls of ``add`` to devtools/mcp_mqtt_server.py through mosquitto, 2 shared CPU cores,
load 5-15, five runs each, interleaved) against the same provider on SDK 2.3's ClientSession
(bench/mcp_mqtt_sdk.py): one call at a time 4.4-8.2 ms (median 6.9) here, 10.5-12.0 ms
(median 11.4) on the SDK; 16 at a time 121-221 calls/s (median 182) here, 101-123 (median
103) on the SDK; discovery to tools offered 51-60 ms here, 56-104 on the SDK. Without a
broker, in one process, the SDK's session costs 1.3 ms of CPU a call (pydantic models, its
dispatcher, a result schema check), this module's JSON-RPC 0.06 ms. The SDK also refuses the
error shapes and oversize answers this module ends as one call's ``error``; over MQTT it
would need the repairs mcp.py gives stdio, and a transport that routes instances. Measure
again with a new SDK.

What is implemented, with ``R`` the configured ``topic_root`` ("$mcp" as the specification
has it), ``C`` the worker's mcp-client-id (the ``client_id`` given), ``S`` a server's
server-id (its MQTT client id) and ``N`` its server-name (a hierarchical name, may hold "/"):

- Discovery: watch ``R-server/presence/+/{server_filter}``. A retained
  ``notifications/server/online`` there records instance S of server N; an empty payload
  (the server's clean shutdown, or its will after a crash) removes it. As long as one instance
  of N is online, N is online: the client initializes with one instance at a time.
- Initialization: watch ``R-rpc/C/+/{server_filter}`` and ``R-server/capability/+/{server_filter}``
  (before any initialize, as the specification requires), publish the ``initialize`` request on
  the server's control topic ``R-server/S/N``; the server answers on the RPC topic
  ``R-rpc/C/S/N``; then ``notifications/initialized`` and ``tools/list`` (every page) on it.
- Calls: ``tools/call`` on ``R-rpc/C/S/N``, answered there; the result as for [[tools.mcp]]
  (text joined, isError: an error result). A server's ``ping`` request is answered, any other
  request refused (-32601: the worker offers no roots, sampling or elicitation).
- Changes: ``notifications/tools/list_changed`` on ``R-server/capability/S/N`` lists again;
  ``notifications/disconnected`` on the RPC topic, or the presence cleared, withdraws the
  instance (another online instance of N is initialized, else N's tools are withdrawn).
- Shutdown: ``notifications/disconnected`` on ``R-client/presence/C`` (the client presence
  topic) when the provider closes.
- Every PUBLISH carries the user properties ``MCP-COMPONENT-TYPE: mcp-client`` and
  ``MCP-MQTT-CLIENT-ID: C`` (the specification's MUST; servers read the client id of an
  initialize from the latter), QoS 1; a tools/call expires (MQTT 5 Message Expiry) with its
  timeout, so a server never runs a call nobody waits for any more.

Where it departs from the specification, because the connection is the worker's own and is
shared with its chat traffic:

- C is not a fresh MQTT client id per initialization, and the CONNECT carries no
  ``MCP-COMPONENT-TYPE``/``MCP-META`` user properties and no will on ``R-client/presence/C``:
  the worker's connection has one will (its status). A worker that dies leaves its sessions
  on the servers until they notice (their pings go unanswered).
- The Messaging port has no No Local subscription option: the worker's own messages on the
  RPC topic come back to it, and are told apart by ``MCP-COMPONENT-TYPE: mcp-client``.

Mosquitto (2.0.11, Debian's) carries the ``$mcp-...`` topics: a client may publish to them,
retained messages are kept, and explicit subscriptions (``$mcp-server/presence/+/...``) get
them; only filters starting with a wildcard (``#``, ``+/...``) do not match them, as MQTT
requires of topics beginning with "$" (tests/broker/test_mcp_mqtt.py shows both).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loguru import logger

from ..config.models import McpMqttConfig
from ..transport.port import Delivery, Messaging, OutboundProperties, PublishFailed
from . import offer
from .mcp import result_outcome
from .port import CallContext, ToolOutcome, WorkerTool, error_message

PROTOCOL_VERSION = "2025-06-18"  # the MCP revision the specification is written against
INIT_TIMEOUT = 30.0  # the specification's recommended timeouts for initialize and tools/list
LIST_TIMEOUT = 30.0

_ID = re.compile(rb'"id"\s*:\s*(\d{1,15})\b')


class RpcError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def rpc_error(error: Any) -> RpcError:
    """A JSON-RPC error object as a server sent it, whatever its shape: a code that is not an
    integer is -32603 (internal error), a message that is missing, not a string or huge is
    replaced or cut, ``data`` is not used."""
    body = error if isinstance(error, dict) else {}
    code = body.get("code")
    if not isinstance(code, int) or isinstance(code, bool):
        code = -32603
    fallback = f"the MCP server answered with a JSON-RPC error (code {code})"
    return RpcError(code, error_message(body.get("message"), fallback))


class ServerGone(Exception):
    """The instance a request was sent to went offline before it answered."""


@dataclass
class _Server:
    """One server-name: its online instances, the one initialized, its tools."""

    name: str
    instances: list[str] = field(default_factory=list)  # server-ids, in the order they came online
    active: str | None = None  # the instance initialized (or being initialized)
    ready: bool = False
    tools: offer.Offered = field(default_factory=dict)
    task: asyncio.Task[None] | None = None  # initialize + list, or list again


class McpOverMqtt:
    """A ToolProvider for every MCP server on the broker whose server-name matches
    ``config.server_filter``."""

    def __init__(
        self, config: McpMqttConfig, messaging: Messaging, client_id: str, *, max_message_bytes: int = 1 << 20
    ) -> None:
        if any(c in client_id for c in "/+#") or not client_id:
            raise ValueError(f"the mcp-client-id {client_id!r} must be non-empty, without '/', '+' or '#'")
        self.config = config
        self.messaging = messaging
        self.client_id = client_id
        # A message over this is not parsed (_too_large): Python's json holds the GIL for the
        # whole parse, in a thread too (10 MB of escapes: 0.33 s on a busy 2-core machine),
        # and a result the model gets is cut to max_tool_result_bytes anyway.
        self.max_message_bytes = max_message_bytes
        self.name = "mcp-mqtt"
        root = config.topic_root
        self._server_root = f"{root}-server"
        self._rpc_root = f"{root}-rpc"
        self._client_presence = f"{root}-client/presence/{client_id}"
        flt = config.server_filter or "#"
        self._filters = (
            f"{self._server_root}/presence/+/{flt}",
            f"{self._server_root}/capability/+/{flt}",
            f"{self._rpc_root}/{client_id}/+/{flt}",
        )
        self._servers: dict[str, _Server] = {}
        self._pending: dict[int, tuple[str, str, asyncio.Future[Any]]] = {}  # id -> (server, instance, answer)
        self._ids = itertools.count(1)
        self._watching: list[str] = []
        self._closing = False
        self._offering = offer.ToolOffer(config, "MCP over MQTT: server")

    # -- ToolProvider -------------------------------------------------------------------

    def tools(self) -> Sequence[WorkerTool]:
        return [tool for server in self._servers.values() for tool, _ in server.tools.values()]

    async def start(self) -> None:
        """Watch the RPC and capability topics first, the presence topic last: a retained
        presence starts an initialize, whose answer must find the RPC topic watched. A watch
        the broker refuses is logged: no discovery, the worker still starts."""
        if self.config.server_filter is None:
            return
        handlers = (self._on_presence, self._on_capability, self._on_rpc)
        for topic_filter, handler in reversed(list(zip(self._filters, handlers, strict=True))):
            try:
                await self.messaging.watch(topic_filter, handler)
            except PublishFailed as exc:
                logger.error("MCP over MQTT: cannot watch {}: {}; no servers discovered there", topic_filter, exc)
                return
            self._watching.append(topic_filter)
        logger.info("MCP over MQTT: discovering servers {} as {}", self.config.server_filter, self.client_id)

    async def close(self) -> None:
        self._closing = True
        for topic_filter in self._watching:
            with contextlib.suppress(Exception):
                self.messaging.unwatch(topic_filter)
        self._watching.clear()
        for server in self._servers.values():
            if server.task is not None:
                server.task.cancel()
        self._fail_pending(lambda _server, _instance: True)
        if self._servers:
            done = self._send(self._client_presence, {"jsonrpc": "2.0", "method": "notifications/disconnected"})
            with contextlib.suppress(Exception):
                await asyncio.wait_for(done, 5.0)

    async def call(self, tool: str, arguments: Mapping[str, Any], context: CallContext) -> ToolOutcome:
        for server in self._servers.values():
            if tool in server.tools:
                break
        else:
            return ToolOutcome(f"Error: no MCP server on the broker offers {tool} now.", "unavailable")
        if not server.ready or server.active is None:
            return ToolOutcome(f"Error: the MCP server {server.name} is not available.", "unavailable")
        timeout = self.config.timeout
        params = {"name": server.tools[tool][1], "arguments": dict(arguments)}
        try:
            result = await self._request(server, "tools/call", params, timeout, expiry=timeout)
        except TimeoutError:
            logger.warning("MCP over MQTT: {} of {} did not answer within {:g} s", tool, server.name, timeout)
            return ToolOutcome(f"Error: the MCP server {server.name} did not answer within {timeout:g} s.", "timeout")
        except (ServerGone, PublishFailed):
            return ToolOutcome(f"Error: the MCP server {server.name} is not available.", "unavailable")
        except RpcError as exc:
            # The server's words may quote the arguments: DEBUG only, like user text.
            logger.info("MCP over MQTT: {} of {} answered a JSON-RPC error ({})", tool, server.name, exc.code)
            logger.debug("MCP over MQTT: {} of {} failed: {}", tool, server.name, exc.message)
            return ToolOutcome(f"Error: {exc.message}", "error")
        return result_outcome(result, f"MCP over MQTT: {tool} of {server.name}")

    # -- messages -------------------------------------------------------------------------

    def _on_presence(self, delivery: Delivery) -> None:
        parts = delivery.topic.split("/", 3)
        if len(parts) != 4:
            return
        instance, name = parts[2], parts[3]
        server = self._servers.get(name)
        if not delivery.payload:
            if server is not None and instance in server.instances:
                server.instances.remove(instance)
                logger.info("MCP over MQTT: server {} ({}) went offline", name, instance)
                if server.active == instance:
                    self._drop_active(server)
            return
        message = _parsed(delivery.payload)
        if message is None:
            logger.warning("MCP over MQTT: unreadable presence of {} ({}) ignored", name, instance)
            return
        if message.get("method") != "notifications/server/online":
            return
        if server is None:
            server = self._servers[name] = _Server(name)
        if instance not in server.instances:
            server.instances.append(instance)
            logger.info("MCP over MQTT: server {} ({}) is online", name, instance)
        if server.active is None and not self._closing:
            self._activate(server, instance)

    def _on_capability(self, delivery: Delivery) -> None:
        parts = delivery.topic.split("/", 3)
        if len(parts) != 4 or _from_client(delivery):
            return
        server = self._servers.get(parts[3])
        if server is None or server.active != parts[2] or not server.ready:
            return
        message = _parsed(delivery.payload)
        if message is None:
            logger.debug("MCP over MQTT: unreadable capability message from {} ({}) ignored", parts[3], parts[2])
        elif message.get("method") == "notifications/tools/list_changed":
            self._spawn(server, self._relist(server))

    def _on_rpc(self, delivery: Delivery) -> None:
        parts = delivery.topic.split("/", 3)
        if len(parts) != 4 or _from_client(delivery):
            return  # our own requests, back from the broker (no No Local through the port)
        instance, name = parts[2], parts[3]
        if len(delivery.payload) > self.max_message_bytes:
            self._too_large(delivery.payload, name, instance)
            return
        message = _parsed(delivery.payload)
        if message is None:
            self._unreadable(delivery.payload, name, instance)
            return
        method = message.get("method")
        server = self._servers.get(name)
        if method is None:  # a response
            request_id = message.get("id")
            pending = self._pending.get(request_id) if isinstance(request_id, int) else None
            if pending is None or pending[:2] != (name, instance) or pending[2].done():
                return
            if "error" in message:  # an error of any shape ends this request, never the server
                pending[2].set_exception(rpc_error(message["error"]))
            else:
                pending[2].set_result(message.get("result"))
        elif method == "notifications/disconnected":
            if server is not None and server.active == instance:
                logger.info("MCP over MQTT: server {} ({}) ended the session", name, instance)
                with contextlib.suppress(ValueError):
                    server.instances.remove(instance)
                self._drop_active(server)
        elif method == "notifications/tools/list_changed":
            if server is not None and server.active == instance and server.ready:
                self._spawn(server, self._relist(server))
        elif isinstance(message.get("id"), str | int):  # a request of the server's (MCP: a string or integer id)
            answer: dict[str, Any] = {"jsonrpc": "2.0", "id": message["id"]}
            if method == "ping":
                answer["result"] = {}
            else:
                answer["error"] = {"code": -32601, "message": f"the worker does not offer {str(method)[:80]}"}
            self._send(delivery.topic, answer)

    def _too_large(self, payload: bytes, name: str, instance: str) -> None:
        """A message over max_message_bytes is not parsed: the request it answers ends now as
        an error that says so, instead of waiting out its timeout (_end_named)."""
        size, limit = len(payload), self.max_message_bytes
        logger.warning(
            "MCP over MQTT: a message of {} bytes from {} ({}) not read (over {})", size, name, instance, limit
        )
        self._end_named(
            payload, name, instance, f"the MCP server's answer was {size} bytes, over the {limit} this worker reads"
        )

    def _unreadable(self, payload: bytes, name: str, instance: str) -> None:
        """A message that is not a JSON-RPC message (not JSON, nested too deep to parse, not
        a JSON object) is ignored; a request it may answer ends now as an error that says
        so, instead of waiting out its timeout (_end_named)."""
        logger.warning("MCP over MQTT: unreadable message from {} ({}) ignored", name, instance)
        self._end_named(payload, name, instance, "the MCP server's answer is not a readable JSON-RPC message")

    def _end_named(self, payload: bytes, name: str, instance: str, why: str) -> None:
        """End, as an error saying ``why``, the pending request of this instance whose id is
        found near the start or the end of an unparsed ``payload`` (where a JSON-RPC response
        has it)."""
        for found in _ID.finditer(payload[:512] + b" " + payload[-512:]):
            pending = self._pending.get(int(found.group(1)))
            if pending is not None and pending[:2] == (name, instance) and not pending[2].done():
                pending[2].set_exception(RpcError(-32603, why))
                return

    # -- sessions ---------------------------------------------------------------------

    def _activate(self, server: _Server, instance: str) -> None:
        server.active, server.ready = instance, False
        self._spawn(server, self._initialize(server, instance))

    def _drop_active(self, server: _Server) -> None:
        """The active instance is gone: its requests end as unavailable; another online
        instance takes over, or the server's tools are withdrawn."""
        gone = server.active
        server.active, server.ready = None, False
        if server.task is not None:
            server.task.cancel()
            server.task = None
        self._fail_pending(lambda name, instance: name == server.name and instance == gone)
        if server.instances and not self._closing:
            self._activate(server, server.instances[0])
        elif server.tools:
            server.tools = {}
            logger.info("MCP over MQTT: tools of {} withdrawn", server.name)

    def _spawn(self, server: _Server, work: Any) -> None:
        if server.task is not None and not server.task.done():
            server.task.cancel()
        server.task = asyncio.create_task(work, name=f"mcp-mqtt-{server.name}")

    async def _initialize(self, server: _Server, instance: str) -> None:
        params = {
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {},
            "clientInfo": {"name": "mqtt-vllm-worker", "version": _version()},
        }
        try:
            control = f"{self._server_root}/{instance}/{server.name}"
            result = await self._request(server, "initialize", params, INIT_TIMEOUT, topic=control, instance=instance)
            if not isinstance(result, dict) or not isinstance(result.get("capabilities"), dict):
                raise RpcError(-32603, "an initialize result without capabilities")
            initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
            await self._send(self._rpc_topic(instance, server.name), initialized)
            server.ready = True
            await self._list(server)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The instance stays recorded: a new presence (the server restarting) tries again.
            logger.warning("MCP over MQTT: cannot initialize {} ({}): {}", server.name, instance, type(exc).__name__)
            logger.debug("MCP over MQTT: initializing {} ({}) failed: {}", server.name, instance, exc)
            if server.active == instance:
                server.active, server.ready = None, False
                with contextlib.suppress(ValueError):
                    server.instances.remove(instance)
                server.tools = {}
            return
        logger.info("MCP over MQTT: {} ({}) initialized, {} tools offered", server.name, instance, len(server.tools))

    async def _relist(self, server: _Server) -> None:
        try:
            await self._list(server)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("MCP over MQTT: cannot list the tools of {} again ({})", server.name, type(exc).__name__)
            logger.debug("MCP over MQTT: listing the tools of {} failed: {}", server.name, exc)

    async def _list(self, server: _Server) -> None:
        async def page(cursor: str | None) -> Any:
            return await self._request(server, "tools/list", {"cursor": cursor} if cursor else {}, LIST_TIMEOUT)

        self._offer(server, *await self._offering.list_all(server.name, page))

    def _offer(
        self, server: _Server, listed: list[dict[str, Any]], problems: list[offer.SchemaUnusable | None] | None = None
    ) -> None:
        """Offer the listed tools that ``allow`` names and whose name and schema can be used
        (``problems``: offer.screen's verdicts, computed here when not given)."""
        prefix = offer.name_part(server.name) + "_"
        offered = self._offering.offered(server.name, prefix, f"mcp-mqtt:{server.name}", listed, problems)
        if offered != server.tools:
            server.tools = offered
            logger.info("MCP over MQTT: {} offers: {}", server.name, ", ".join(sorted(offered)) or "no tools")

    async def _request(
        self,
        server: _Server,
        method: str,
        params: dict[str, Any],
        timeout: float,
        *,
        topic: str | None = None,
        instance: str | None = None,
        expiry: float | None = None,
    ) -> Any:
        instance = instance or server.active
        if instance is None:
            raise ServerGone(server.name)
        request_id = next(self._ids)
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (server.name, instance, answer)
        try:
            message = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
            sent = self._send(topic or self._rpc_topic(instance, server.name), message, expiry=expiry)

            async def exchange() -> Any:
                await sent
                return await answer

            return await asyncio.wait_for(exchange(), timeout)
        finally:
            self._pending.pop(request_id, None)
            if not answer.done():
                answer.cancel()

    def _send(self, topic: str, message: dict[str, Any], *, expiry: float | None = None) -> asyncio.Future[None]:
        properties = OutboundProperties(
            message_expiry=math.ceil(expiry) if expiry else None,
            user_properties=(("MCP-COMPONENT-TYPE", "mcp-client"), ("MCP-MQTT-CLIENT-ID", self.client_id)),
            content_type="application/json",
        )
        return self.messaging.send(topic, json.dumps(message).encode(), qos=1, properties=properties)

    def _rpc_topic(self, instance: str, name: str) -> str:
        return f"{self._rpc_root}/{self.client_id}/{instance}/{name}"

    def _fail_pending(self, which: Callable[[str, str], bool]) -> None:
        for server_name, instance, answer in list(self._pending.values()):
            if which(server_name, instance) and not answer.done():
                answer.set_exception(ServerGone(server_name))


def _parsed(payload: bytes) -> dict[str, Any] | None:
    """A message as a JSON object; None: not JSON (or not UTF-8), nested deeper than Python's
    json parses (RecursionError, not a ValueError), or not an object: every message of MCP over
    MQTT is one (no JSON-RPC batches since MCP 2025-06-18)."""
    try:
        message = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    return message if isinstance(message, dict) else None


def _from_client(delivery: Delivery) -> bool:
    return ("MCP-COMPONENT-TYPE", "mcp-client") in delivery.user_properties


def _version() -> str:
    from .. import __version__

    return str(__version__)

"""One MCP server's tools as worker tools (``[[tools.mcp]]``): a stdio server the worker
starts (``command``, ``env``) or a streamable HTTP server (``url``), through the official MCP
SDK (the optional extra ``mcp``: ``pip install -e '.[mcp]'`` in the clone; the only module of
the worker that imports it).

The connection belongs to one supervisor task per server: the SDK's context managers (anyio
task groups) must be entered and left in the same task, so nothing else enters them. The
supervisor connects, lists the tools, lists them again when the server sends
notifications/tools/list_changed, pings the server now and then, and, when the server dies
(a stdio child that exits, an HTTP server that goes away), connects again after 1 s, doubling
up to 30 s. Only changes of state are logged at INFO/WARNING (up, down), retries at DEBUG.

Calls run from the turn's task on the supervisor's session: a server that is down answers
"unavailable" at once (never a hung turn); the tools it offered last stay listed (the model
gets that error result rather than a tool that comes and goes with every restart), a server
never listed offers none.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from loguru import logger

from ..config.models import McpServerConfig
from ..protocol.images import sniff_media_type
from . import offer
from .port import CallContext, ToolOutcome, WorkerTool, error_message, safe_json

INSTALL_HINT = "pip install -e '.[mcp]' in the worker's clone (or pip install 'mcp>=2.3,<3')"

# JSON-RPC error code of a connection that closed under a request (the SDK's CONNECTION_CLOSED).
CONNECTION_CLOSED = -32000


class McpSdkMissing(RuntimeError):
    """[[tools.mcp]] is configured but the MCP SDK is not installed: the worker does not start
    (a configured tool that silently never appears is worse than a clear refusal)."""


def require_sdk() -> None:
    try:
        import mcp  # noqa: F401
    except ImportError as exc:
        raise McpSdkMissing(
            f"[[tools.mcp]] is configured but the MCP SDK is not installed ({exc}): {INSTALL_HINT}"
        ) from None


class ServerLost(Exception):
    """The supervisor's session ended: the server exited, closed the connection, or did not
    answer a ping."""


class McpServerTools:
    """A ToolProvider for one ``[[tools.mcp]]`` server.

    ``start_wait``: how long start() waits for the first listing (or the first failure);
    ``backoff``: the first and the longest delay between connection attempts;
    ``health_interval``: how often an idle connection is pinged (a dead stdio child is also
    noticed at once by the next call)."""

    def __init__(
        self,
        config: McpServerConfig,
        *,
        start_wait: float = 10.0,
        backoff: tuple[float, float] = (1.0, 30.0),
        health_interval: float = 10.0,
    ) -> None:
        require_sdk()
        self.config = config
        self.name = f"mcp:{config.name}"
        self.start_wait = start_wait
        self.backoff = backoff
        self.health_interval = health_interval
        self._prefix = f"{config.name}_"
        self._tools: offer.Offered = {}
        self._session: Any = None  # the SDK's ClientSession while the server is up
        self._supervisor: asyncio.Task[None] | None = None
        self._attempted = asyncio.Event()  # the first connection attempt ended (listed or failed)
        self._wake = asyncio.Event()  # the supervisor has something to do
        self._relist = False
        self._lost: str | None = None
        self._stopping = False
        self._up: bool | None = None  # None: no attempt ended yet
        self._offering = offer.ToolOffer(config, "MCP server")

    # -- ToolProvider -------------------------------------------------------------------

    def tools(self) -> Sequence[WorkerTool]:
        return [tool for tool, _ in self._tools.values()]

    async def start(self) -> None:
        if self._supervisor is None:
            self._supervisor = asyncio.create_task(self._supervise(), name=f"mcp-{self.config.name}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._attempted.wait(), self.start_wait)
        if not self._attempted.is_set():
            logger.warning(
                "MCP server {} has not answered within {:g} s; the worker starts without its tools for now",
                self.config.name,
                self.start_wait,
            )

    async def close(self) -> None:
        """Stop the supervisor: it leaves the SDK's context managers itself (the stdio child
        gets its stdin closed, then SIGTERM, then SIGKILL, as the SDK does it); cancelled only
        if it does not end in time."""
        self._stopping = True
        self._wake.set()
        task, self._supervisor = self._supervisor, None
        if task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), 15.0)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        except Exception:  # the supervisor never raises, but close must not either
            logger.opt(exception=True).debug("MCP server {}: supervisor ended with an error", self.config.name)

    async def call(self, tool: str, arguments: Mapping[str, Any], context: CallContext) -> ToolOutcome:
        server = self.config.name
        found = self._tools.get(tool)
        if found is None:
            return ToolOutcome(f"Error: the MCP server {server} offers no tool {tool}.", "unavailable")
        session = self._session
        if session is None:
            return ToolOutcome(f"Error: the MCP server {server} is not available.", "unavailable")
        try:
            result = await asyncio.wait_for(session.call_tool(found[1], dict(arguments)), self.config.timeout)
        except TimeoutError:
            logger.warning("MCP server {}: {} did not answer within {:g} s", server, tool, self.config.timeout)
            return ToolOutcome(
                f"Error: the MCP server {server} did not answer within {self.config.timeout:g} s.", "timeout"
            )
        except Exception as exc:  # CancelledError is a BaseException: it goes through
            if _transport_broken(exc) or (_maybe_closed(exc) and not await self._answers(session)):
                self._set_lost("the connection closed during a call")
                return ToolOutcome(f"Error: the MCP server {server} is not available.", "unavailable")
            # Any other error, whatever its code (a server's own -32000 included), ends this
            # call only: the server stays up for every other call.
            code = getattr(getattr(exc, "error", None), "code", None)
            fallback = (
                f"the MCP server {server} answered with an error ({code if code is not None else type(exc).__name__})"
            )
            message = error_message(getattr(exc, "message", None) or str(exc), fallback)
            # The server's words may quote the arguments: DEBUG only, like user text.
            logger.warning("MCP server {}: {} failed ({}, code {})", server, tool, type(exc).__name__, code)
            logger.debug("MCP server {}: {} failed: {}", server, tool, message)
            return ToolOutcome(f"Error: {message}", "error")
        return result_outcome(_dump(result), f"MCP server {server}: {tool}")

    async def _answers(self, session: Any) -> bool:
        """Whether the server still answers on this session: a call's error said "connection
        closed" (-32000), which is the SDK's word for a closed transport and also the generic
        server error a server may send itself. A ping tells them apart: a closed transport
        fails it at once, a live server answers it (a busy one may take its time: it is not
        taken for closed; the supervisor's own pings watch it)."""
        try:
            await asyncio.wait_for(session.send_ping(), 5.0)
        except TimeoutError:
            return True
        except Exception as exc:
            return not (_transport_broken(exc) or _maybe_closed(exc))
        return True

    # -- the supervisor -------------------------------------------------------------------

    async def _supervise(self) -> None:
        delay = self.backoff[0]
        while not self._stopping:
            reason = "closed"
            try:
                await self._connect_once()
            except Exception as exc:
                reason = _reason(exc)
            finally:
                self._session = None
            if self._stopping:
                break
            # A connection that came up starts the backoff anew; failed attempts double it.
            wait = self.backoff[0] if self._up else delay
            if self._up is not False:  # a change of state: logged once, not every retry
                logger.warning(
                    "MCP server {} is down ({}); retrying in the background, up to every {:g} s",
                    self.config.name,
                    reason,
                    self.backoff[1],
                )
            else:
                logger.debug("MCP server {}: still down ({}), next try in {:g} s", self.config.name, reason, wait)
            self._up = False
            self._attempted.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped(), wait)
            delay = min(wait * 2, self.backoff[1])

    async def _stopped(self) -> None:
        while not self._stopping:
            self._wake.clear()
            await self._wake.wait()

    async def _connect_once(self) -> None:
        from mcp import ClientSession

        self._lost = None
        self._relist = False
        async with (
            self._transport() as streams,
            ClientSession(streams[0], streams[1], message_handler=self._on_message) as session,
        ):
            await asyncio.wait_for(session.initialize(), max(self.start_wait, 5.0))
            await self._list(session)
            self._session = session
            if not self._up:
                logger.info("MCP server {} is up: {} tools offered", self.config.name, len(self._tools))
            self._up = True
            self._attempted.set()
            while not self._stopping:
                try:
                    await asyncio.wait_for(self._wake.wait(), self.health_interval)
                except TimeoutError:
                    try:
                        await asyncio.wait_for(session.send_ping(), 10.0)
                    except TimeoutError:
                        raise ServerLost("no answer to a ping") from None
                    continue
                self._wake.clear()
                if self._lost is not None:
                    raise ServerLost(self._lost)
                if self._relist:
                    self._relist = False
                    await self._list(session)
            self._session = None  # no new call starts on a session that is closing

    @contextlib.asynccontextmanager
    async def _transport(self) -> AsyncIterator[Any]:
        """The SDK's transport: (read stream, write stream), the SDK 1.x HTTP client's third
        item (its session id getter) unused."""
        config = self.config
        if config.command is not None:
            from mcp import StdioServerParameters, stdio_client

            # The child gets the SDK's safe environment (PATH, HOME, USER, ...) and the config's env.
            # Bytes it writes that are not UTF-8 become U+FFFD (strict, the SDK's default, ends
            # the session on the first one).
            params = StdioServerParameters(
                command=config.command[0],
                args=config.command[1:],
                env=config.env or None,
                encoding_error_handler="replace",
            )
            async with stdio_client(params) as streams, _repairing(streams[0]) as read:
                yield read, streams[1]
        else:
            assert config.url is not None
            try:
                from mcp.client.streamable_http import streamable_http_client as http_client
            except ImportError:  # SDK 1.x
                from mcp.client.streamable_http import streamablehttp_client as http_client  # type: ignore[attr-defined,no-redef]
            async with http_client(config.url) as streams:
                yield streams

    async def _list(self, session: Any) -> None:
        async def page(cursor: str | None) -> dict[str, Any]:
            if cursor is None:
                return _dump(await asyncio.wait_for(session.list_tools(), 30.0))
            from mcp import types

            params = types.PaginatedRequestParams(cursor=cursor)
            return _dump(await asyncio.wait_for(session.list_tools(params=params), 30.0))

        self._offer(*await self._offering.list_all(self.config.name, page))

    def _offer(self, listed: list[dict[str, Any]], problems: list[offer.SchemaUnusable | None] | None = None) -> None:
        """Offer the listed tools that ``allow`` names and whose name and schema can be used
        (``problems``: offer.screen's verdicts, computed here when not given)."""
        offered = self._offering.offered(self.config.name, self._prefix, self.name, listed, problems)
        changed = offered != self._tools
        self._tools = offered
        if changed:
            logger.info("MCP server {} offers: {}", self.config.name, ", ".join(sorted(offered)) or "no tools")

    async def _on_message(self, message: Any) -> None:
        """The SDK's message handler (in the session's task): a tools/list_changed makes the
        supervisor list again; a transport error is only logged (the ping or the next call
        finds out whether the connection is gone)."""
        if isinstance(message, Exception):
            logger.debug("MCP server {}: transport error: {}", self.config.name, _reason(message))
            return
        if getattr(message, "method", None) == "notifications/tools/list_changed" or (
            getattr(getattr(message, "root", None), "method", None) == "notifications/tools/list_changed"
        ):
            self._relist = True
            self._wake.set()

    def _set_lost(self, why: str) -> None:
        if self._lost is None:
            self._lost = why
        self._session = None
        self._wake.set()


@contextlib.asynccontextmanager
async def _repairing(source: Any) -> AsyncIterator[Any]:
    """The stdio transport's read stream, with the lines the SDK could not parse repaired
    where they can be (_repair): a response the SDK refuses (an error whose code is not an
    integer or whose message is missing, a lone surrogate escape anywhere) would otherwise
    leave its call waiting out its timeout."""
    import anyio

    send, receive = anyio.create_memory_object_stream[Any](0)

    async def forward() -> None:
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
            async with send:
                async for item in source:
                    await send.send(_repair(item) if isinstance(item, Exception) else item)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(forward)
        try:
            yield receive
        finally:
            tasks.cancel_scope.cancel()
            receive.close()


def _repair(exc: Exception) -> Any:
    """A line the SDK could not parse (its exception, with the line as pydantic's input), as a
    message the session can use: the message with every string made valid Unicode if that
    parses; else, for a response to one of our requests, a JSON-RPC error for that request
    (so that the call ends now, as ``error``); else the exception as it was."""
    from mcp import types
    from mcp.shared.message import SessionMessage

    raw = _raw_message(exc)
    if not isinstance(raw, dict):
        return exc
    fixed = safe_json(raw)
    try:
        return SessionMessage(types.jsonrpc_message_adapter.validate_python(fixed))
    except ValueError:
        pass
    request_id = fixed.get("id")
    if "method" in fixed or not isinstance(request_id, int | str) or isinstance(request_id, bool):
        return exc
    error = fixed.get("error") if isinstance(fixed.get("error"), dict) else {}
    code = error.get("code")
    code = code if isinstance(code, int) and not isinstance(code, bool) else -32603
    if "error" in fixed:
        message = error_message(error.get("message"), f"the MCP server answered with a JSON-RPC error (code {code})")
    else:
        message = "the MCP server's answer is not a valid MCP result"
    error_data = types.ErrorData(code=code, message=message)
    return SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error_data))


def _raw_message(exc: Exception) -> Any:
    """The JSON value of the line behind a pydantic ValidationError of the SDK's parser: the
    message object pydantic reports as the input of a missing field, or the line itself
    where it was not JSON to pydantic (a lone surrogate escape: Python's json takes it)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return None
    try:
        items = list(errors())
    except Exception:
        return None
    for item in items:
        value = item.get("input")
        if isinstance(value, dict) and "jsonrpc" in value:
            return value
    for item in items:
        value = item.get("input")
        if isinstance(value, str | bytes) and not item.get("loc"):
            try:
                return json.loads(value)
            except (ValueError, RecursionError):  # RecursionError: a line nested past the decoder's depth
                return None
    return None


def _dump(model: Any) -> dict[str, Any]:
    """A SDK result as its wire JSON (camelCase in SDK 1.x and 2.x alike)."""
    data = model.model_dump(by_alias=True, mode="json", exclude_none=True)
    return data if isinstance(data, dict) else {}


class InvalidResult(ValueError):
    """A tools/call result that is not of MCP's shape (its words: what is wrong, never the
    server's text)."""


def result_outcome(result: Any, call: str = "An MCP server's call") -> ToolOutcome:
    """A tools/call result (its wire JSON) as the model gets it: text items joined, other
    content described briefly, structuredContent as JSON when there is no text; isError: an
    error outcome. Also MCP over MQTT's (mcp_mqtt.py), which needs no SDK: there it is the JSON
    a server published, of any shape, so a result that is not MCP's shape is an ``error``
    outcome that says what is wrong (logged at WARNING, ``call`` naming the server and the
    tool), never an exception (the toolbox would log it as the worker's bug)."""
    try:
        return _result_outcome(result)
    except InvalidResult as exc:
        reason = str(exc)
    except RecursionError:
        # A value nested about as deep as json.loads goes: str() or json.dumps of it, called
        # deeper in the stack than the parse, goes over the recursion limit.
        reason = "it nests too deep"
    logger.warning("{} answered with a result that is not a valid MCP result ({})", call, reason)
    return ToolOutcome(f"Error: the MCP server's answer is not a valid MCP result: {reason}.", "error")


def _result_outcome(result: Any) -> ToolOutcome:
    if not isinstance(result, dict):
        raise InvalidResult("it is not a JSON object")
    content = result.get("content")
    if content is None:
        content = []
    if not isinstance(content, list):
        raise InvalidResult("its content is not a list")
    parts: list[str] = []
    images: list[tuple[bytes, str]] = []
    texts = 0
    for item in content:
        if not isinstance(item, dict):
            raise InvalidResult("a content item is not a JSON object")
        kind = item.get("type")
        if kind == "text":
            parts.append(str(item.get("text", "")))
            texts += 1
        elif kind == "image" and (image := _image(item)) is not None:
            images.append(image)
            parts.append(f"[{image[1]}, {len(image[0])} bytes]")
        elif kind in ("image", "audio"):
            size = _decoded_size(item.get("data", ""), f"an {kind} item's data")
            parts.append(f"[{item.get('mimeType', kind)}, {size} bytes]")
        elif kind == "resource":
            resource = item.get("resource")
            if resource is None:
                resource = {}
            if not isinstance(resource, dict):
                raise InvalidResult("a resource item's resource is not a JSON object")
            if "text" in resource:
                parts.append(str(resource["text"]))
                texts += 1
            else:
                size = _decoded_size(resource.get("blob", ""), "a resource's blob")
                parts.append(
                    f"[resource {resource.get('uri', '')}, {resource.get('mimeType', 'binary')}, {size} bytes]"
                )
        elif kind == "resource_link":
            parts.append(f"[resource {item.get('uri', '')}]")
        else:
            parts.append(f"[{kind} content]")
    if not texts and result.get("structuredContent") is not None:
        parts.insert(0, json.dumps(result["structuredContent"], ensure_ascii=False))
    text = "\n".join(parts)
    if result.get("isError"):
        return ToolOutcome(text or "Error: the tool failed.", "error")
    return ToolOutcome(text, images=tuple(images))


def _image(item: dict[str, Any]) -> tuple[bytes, str] | None:
    """An image content item's bytes and type, where they are base64 of an image the worker
    takes (protocol/images.py MEDIA_TYPES, told from the bytes); None: described only."""
    data = item.get("data")
    if not isinstance(data, str) or not data:
        return None
    try:
        raw = base64.b64decode(data.encode("ascii"), validate=True)
    except (UnicodeEncodeError, ValueError):
        return None
    media_type = sniff_media_type(raw)
    return (raw, media_type) if media_type is not None else None


def _decoded_size(data: Any, what: str) -> int:
    """The size of base64 ``data`` decoded (its length where it is not base64); ``what``
    names it in the InvalidResult of data that is not text."""
    if not isinstance(data, str):
        raise InvalidResult(f"{what} is not text")
    try:
        return len(base64.b64decode(data, validate=False))
    except ValueError:  # not base64, or not ASCII
        return len(data)


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, as the SDK's task groups raise them."""
    inner = getattr(exc, "exceptions", None)
    if isinstance(inner, tuple) and inner:
        return [leaf for each in inner for leaf in _leaves(each)]
    return [exc]


def _reason(exc: BaseException) -> str:
    leaf = _leaves(exc)[0]
    text = str(leaf) or type(leaf).__name__
    return f"{type(leaf).__name__}: {text}"[:300]


def _transport_broken(exc: BaseException) -> bool:
    """The transport's own failure (a stream closed under the call): the server is down."""
    import anyio

    return any(
        isinstance(leaf, anyio.ClosedResourceError | anyio.BrokenResourceError | anyio.EndOfStream)
        for leaf in _leaves(exc)
    )


def _maybe_closed(exc: BaseException) -> bool:
    """An error with the code the SDK gives a request whose connection closed; a server may
    send the same code (-32000, JSON-RPC's generic server error) for its own failures."""
    return any(getattr(getattr(leaf, "error", None), "code", None) == CONNECTION_CLOSED for leaf in _leaves(exc))

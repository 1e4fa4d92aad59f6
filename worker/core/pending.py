"""A request on its way through the core, and what it produces: the records that the service,
the turn (core/turns.py) and its tool rounds (core/rounds.py) pass between them. No I/O."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from ..engine.port import EngineTimes
from ..protocol.messages import ChatRequest, FunctionCall, RoundOut, ToolCallOut, WorkerCallOut
from ..protocol.topics import SessionAddress
from ..session import SessionHistory, ToolCall
from ..transport.port import InboundMessage


@dataclass
class SessionRuntime:
    """What is in flight for one session; dropped when the session goes idle."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: int = 0  # tasks (turns and resets) waiting for the lock
    running: dict[str, str] = field(default_factory=dict)  # request key -> engine request id
    cancelled: set[str] = field(default_factory=set)  # keys cancelled while queued
    messages: dict[str, list[InboundMessage]] = field(default_factory=dict)  # key -> copies to ack


@dataclass(frozen=True)
class ReplyTarget:
    """Where a request's answer goes: a topic, and the MQTT 5 correlation data to echo."""

    topic: str
    correlation_data: bytes | None


@dataclass
class PendingTurn:
    """One accepted request on its way through the session queue and the engine."""

    message: InboundMessage
    address: SessionAddress
    target: ReplyTarget
    key: str
    request: ChatRequest
    runtime: SessionRuntime
    deadline: float | None = None  # time.monotonic() by which its turn must start, else expired


@dataclass(frozen=True)
class TurnAnswer:
    """A turn's reply, and the session's new state to commit with it (None: nothing changes,
    as for a request cancelled before it ran)."""

    payload: bytes
    state: SessionHistory | None


@dataclass(frozen=True)
class Continuation:
    """A generation of the loop, for the next one to continue token for token: its prompt
    (ids, and the text they encode), and what it generated (text and ids)."""

    prompt_ids: list[int]
    prompt_text: str
    generated_text: str
    generated_ids: list[int]
    forced: bool = False  # a forced call: the generated text is the call's JSON


@dataclass
class Generated:
    """What a generation produced, and when; for the reply, what the request's generations
    produced together (core/rounds.py ``ToolRounds.summed``)."""

    submitted: float  # time.monotonic() when handed to the engine
    first_token: float | None = None
    text: str = ""
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    image_tokens: int = 0  # of prompt_tokens, those the prompt's images took
    reasoning: str | None = None  # the think block, when the request asked for it
    reasoning_tokens: int | None = None  # completion tokens spent reasoning (a model that thinks)
    tool_calls: tuple[ToolCall, ...] = ()  # calls for the client to run (finish_reason tool_calls)
    tool_parse_error: str | None = None  # call markup that was not a valid call
    confirm_ids: set[str] = field(default_factory=set)  # of tool_calls: worker calls to approve
    worker_calls: list[WorkerCallOut] = field(default_factory=list)  # the worker's own calls
    rounds: list[RoundOut] = field(default_factory=list)  # the generations, when the worker called tools
    raw_text: str = ""  # the engine's text as generated (``text`` becomes the answer)
    token_ids: list[int] = field(default_factory=list)  # the ids generated, where the engine says
    engine_times: EngineTimes | None = None  # its first token's wait and prefill in the engine, where it says


def ms_between(start: float, end: float) -> float:
    return round((end - start) * 1000, 1)


def wire_calls(calls: tuple[ToolCall, ...], confirm: set[str] | frozenset[str] = frozenset()) -> list[ToolCallOut]:
    """Calls as the reply and the stream carry them."""
    return [
        ToolCallOut(
            id=c.id,
            function=FunctionCall(name=c.name, arguments=json.dumps(c.arguments, ensure_ascii=False)),
            needs_confirmation=True if c.id in confirm else None,
        )
        for c in calls
    ]

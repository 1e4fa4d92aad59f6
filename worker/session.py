"""A session's data: its conversation as chat messages grouped in turns, its tools, its answers.

The one module that the core (which runs turns), the store (which keeps them) and the engine
adapters (which render them through the model's chat template) all import: it imports none of
them, so no package imports one that depends on it. No I/O here.

A turn is every message one user message led to: the user message, then for each tool round an
assistant message with ``tool_calls`` and one ``tool`` message per call, then the final
assistant message. A turn whose last assistant message asked for calls that have no result yet
is *open*: the session waits for the client's ``toolResults``. Trimming drops whole turns, so a
tool message never loses its call.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

# One message as the chat template takes it (and the stores keep it): role, content, and for
# tool rounds the assistant's tool_calls (arguments as a dict: templates render them with
# tojson) or the tool result's tool_call_id and name (Hermes-style templates need the name).
# The turns hold typed messages (UserMessage, AssistantMessage, ToolResultMessage); this form
# is made at the edges only: the renderer's input, the stored JSON.
ChatMessage = dict[str, Any]
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
ANSWERED_KEYS_PER_SESSION = 256
# What the model is told for a call that was never run: the user sent a new message instead
# of the call's result. Every call then has a result, so no template sees a call without one.
NOT_RUN_RESULT = "The call was not run: the user sent a new message instead."
# What the model is told for a worker tool's call the user did not approve.
DECLINED_RESULT = "The user declined this call; it was not run."
# What the model is told for a worker call that may have been sent before the worker stopped:
# it is never sent again (at most once, docs/reliability.md), and its result was lost.
UNKNOWN_RESULT = (
    "Error: the outcome of this call is unknown: the worker stopped while waiting for its result, "
    "and the call is not sent again."
)


@dataclass(frozen=True)
class ToolSpec:
    """A declared tool, as the client sent it (OpenAI's function tool)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments; None: no arguments
    strict: bool | None = None

    def template_form(self) -> dict[str, Any]:
        """How chat templates take a tool: OpenAI's {"type": "function", "function": {...}}."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters if self.parameters is not None else NO_ARGUMENTS
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}

    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else NO_ARGUMENTS


# OpenAI: omitting parameters defines a function with an empty parameter list.
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: its id (ours, derived from the request), the tool, the
    arguments (a JSON object)."""

    id: str
    name: str
    arguments: dict[str, Any]

    def template_form(self) -> dict[str, Any]:
        """OpenAI's form, with the arguments as a dict: templates render them with tojson."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class _Message:
    """A turn's message. It also reads as its template form (``message["role"]``), and equals
    the dict of that form, for code written against the dicts the chat template takes."""

    role: ClassVar[str]
    content: str

    def template_form(self) -> ChatMessage:
        raise NotImplementedError

    def __getitem__(self, key: str) -> Any:
        return self.template_form()[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.template_form().get(key, default)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Message):
            return type(other) is type(self) and other.template_form() == self.template_form()
        if isinstance(other, dict):
            return self.template_form() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, eq=False)
class UserMessage(_Message):
    """The message that opens a turn."""

    content: str
    role: ClassVar[str] = "user"

    def template_form(self) -> ChatMessage:
        return {"role": "user", "content": self.content}


@dataclass(frozen=True, eq=False)
class AssistantMessage(_Message):
    """What the model said: its text, and the calls it made (a tool round), checked."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    role: ClassVar[str] = "assistant"

    def template_form(self) -> ChatMessage:
        message: ChatMessage = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.template_form() for call in self.tool_calls]
        return message


@dataclass(frozen=True, eq=False)
class ToolResultMessage(_Message):
    """The result of one call (Hermes-style templates need the tool's name too)."""

    call_id: str
    name: str
    content: str
    role: ClassVar[str] = "tool"

    def template_form(self) -> ChatMessage:
        return {"role": "tool", "tool_call_id": self.call_id, "name": self.name, "content": self.content}


Message = UserMessage | AssistantMessage | ToolResultMessage


def message_from_dict(data: ChatMessage) -> Message:
    """A message from its template form (how the stores keep it). TypeError or KeyError for
    a dict that is no message of a turn."""
    role, content = data["role"], str(data.get("content") or "")
    if role == "user":
        return UserMessage(content)
    if role == "assistant":
        calls = tuple(
            ToolCall(str(c["id"]), str(c["function"]["name"]), dict(c["function"]["arguments"]))
            for c in data.get("tool_calls") or ()
        )
        return AssistantMessage(content, calls)
    if role == "tool":
        return ToolResultMessage(str(data["tool_call_id"]), str(data.get("name") or ""), content)
    raise TypeError(f"a turn holds no message of role {str(role)[:40]!r}")


def as_message(message: Message | ChatMessage) -> Message:
    return message if isinstance(message, _Message) else message_from_dict(message)


def template_form(message: Message | ChatMessage) -> ChatMessage:
    """The dict the chat template takes (a dict is taken as it is)."""
    return message.template_form() if isinstance(message, _Message) else message


def assistant_message(content: str, calls: Sequence[ToolCall] = ()) -> AssistantMessage:
    """The model's message; the calls' arguments copied (the turn keeps them as they were)."""
    return AssistantMessage(content, tuple(ToolCall(c.id, c.name, copy.deepcopy(c.arguments)) for c in calls))


def tool_message(call_id: str, name: str, content: str) -> ToolResultMessage:
    return ToolResultMessage(call_id, name, content)


@dataclass
class Turn:
    """One user message and all it led to (see the module's docstring). Messages given in
    their template form (a stored turn) are read into their types."""

    key: str  # the request key of the message that opened it
    messages: list[Message] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [as_message(m) for m in self.messages]

    @classmethod
    def plain(cls, key: str, user: str, assistant: str) -> Turn:
        return cls(key, [UserMessage(user), AssistantMessage(assistant)])

    @property
    def user(self) -> str:
        """The user message that opened the turn."""
        return next((m.content for m in self.messages if isinstance(m, UserMessage)), "")

    @property
    def assistant(self) -> str:
        """The turn's last assistant text (its answer, once the turn is closed)."""
        return next((m.content for m in reversed(self.messages) if isinstance(m, AssistantMessage)), "")

    @property
    def rounds(self) -> int:
        """How many tool rounds (assistant messages with calls) the turn has had."""
        return sum(1 for m in self.messages if isinstance(m, AssistantMessage) and m.tool_calls)

    def calls(self) -> list[ToolCall]:
        """Every call of the turn, in the order they were made."""
        return [c for m in self.messages if isinstance(m, AssistantMessage) for c in m.tool_calls]

    def results(self) -> dict[str, str]:
        """Call id -> its result, for the calls that have one."""
        return {m.call_id: m.content for m in self.messages if isinstance(m, ToolResultMessage)}

    def last_assistant(self) -> int:
        """The index of the turn's last assistant message (-1: none)."""
        return max((i for i, m in enumerate(self.messages) if isinstance(m, AssistantMessage)), default=-1)

    def pending_calls(self) -> list[ToolCall]:
        """The calls of the turn's last tool round that have no result yet ([]: not open)."""
        last = self.last_assistant()
        if last < 0:
            return []
        message = self.messages[last]
        assert isinstance(message, AssistantMessage)
        answered = self.results()
        return [c for c in message.tool_calls if c.id not in answered]

    def template_forms(self) -> list[ChatMessage]:
        return [m.template_form() for m in self.messages]

    def copy(self) -> Turn:
        """A copy to add to (the messages themselves never change: they are shared)."""
        return Turn(self.key, list(self.messages))


@dataclass
class SessionHistory:
    system_prompt: str | None = None
    turns: list[Turn] = field(default_factory=list)
    # The tools the session offers the model (kept like the system prompt: sent once, and the
    # prompt's prefix stays the same turn after turn).
    tools: list[ToolSpec] = field(default_factory=list)
    # request key -> the reply payload it got; a redelivery is answered from here. None: a
    # tombstone (answered before a reset, which deleted the text).
    answered: OrderedDict[str, bytes | None] = field(default_factory=OrderedDict)
    # The worker's own tools the session chose (workerTools): names, or ["*"] for all its
    # namespace may use. Resolved against the toolbox at each turn.
    worker_tools: list[str] = field(default_factory=list)

    @property
    def open_turn(self) -> Turn | None:
        """The last turn, if it waits for tool results."""
        if self.turns and self.turns[-1].pending_calls():
            return self.turns[-1]
        return None

    def messages(self, turns: Sequence[Turn] | None = None) -> list[ChatMessage]:
        out: list[ChatMessage] = []
        if self.system_prompt:
            out.append({"role": "system", "content": self.system_prompt})
        for turn in self.turns if turns is None else turns:
            out.extend(turn.template_forms())
        return out

    def tool_forms(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (None: no tools)."""
        return [tool.template_form() for tool in self.tools] or None

    def draft(self) -> SessionHistory:
        """A copy for a turn to work on (its system prompt, tools, trimming, the new turn):
        the session itself changes only when the answered turn is committed, so a refused or
        failed request leaves it as it was. The open turn is copied (a round adds to it);
        closed turns are shared, since nothing changes them."""
        turns = list(self.turns)
        if turns and self.open_turn is not None:
            turns[-1] = turns[-1].copy()
        return SessionHistory(
            self.system_prompt, turns, list(self.tools), self.answered.copy(), list(self.worker_tools)
        )

    def remember_answer(self, key: str, reply_payload: bytes) -> None:
        self.answered[key] = reply_payload
        self.answered.move_to_end(key)
        while len(self.answered) > ANSWERED_KEYS_PER_SESSION:
            self.answered.popitem(last=False)

    def reset(self) -> None:
        """Forget the conversation, its tools and the answers' text; keep the answered keys so
        an old redelivery is still recognised and never generates again."""
        self.turns.clear()
        self.tools.clear()
        self.worker_tools.clear()
        self.system_prompt = None
        for key in self.answered:
            self.answered[key] = None


@dataclass
class WorkerCallRecord:
    """How one of the worker's own calls ended (kept with the request's progress and listed in
    its reply)."""

    outcome: str  # ok, error, timeout, unavailable, declined, unknown, skipped
    duration_ms: float
    round: int


@dataclass
class Progress:
    """A request's tool loop so far, stored before each worker call is sent and after each
    result: a redelivered request (the worker crashed mid-loop) goes on from here instead of
    generating and calling again. ``turn`` is the turn the request works on, its rounds so
    far included; ``calls`` how its worker calls ended."""

    turn: Turn
    calls: dict[str, WorkerCallRecord] = field(default_factory=dict)

"""Per-session chat history and the trimming that keeps prompts short and prefix-stable.

Token counts come from the model's own tokenizer and chat template (a ``PromptRenderer``),
never from characters. No I/O here.

Why trimming halves: vLLM reuses the KV cache of a prompt's longest cached prefix. Dropping
one old turn per message would shift the whole conversation every turn and make every turn
a cache miss; dropping down to half the limit keeps the prefix stable for several turns.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .messages import ErrorCode, RequestError

ChatMessage = dict[str, str]
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
ANSWERED_KEYS_PER_SESSION = 256


class PromptRenderer(Protocol):
    """The model's chat template and tokenizer (see tokenizer.py)."""

    opens_reasoning: bool  # the generation prompt opens <think> (QwQ-style templates)

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> list[int]: ...

    def count_text(self, text: str) -> int: ...


@dataclass
class Turn:
    key: str
    user: str
    assistant: str


@dataclass(frozen=True)
class HistoryLimits:
    max_turns: int
    max_tokens: int


@dataclass
class SessionHistory:
    system_prompt: str | None = None
    turns: list[Turn] = field(default_factory=list)
    # request key -> the reply payload it got; a redelivery is answered from here.
    answered: OrderedDict[str, bytes] = field(default_factory=OrderedDict)

    def messages(self, turns: Sequence[Turn] | None = None) -> list[ChatMessage]:
        out: list[ChatMessage] = []
        if self.system_prompt:
            out.append({"role": "system", "content": self.system_prompt})
        for turn in self.turns if turns is None else turns:
            out.append({"role": "user", "content": turn.user})
            out.append({"role": "assistant", "content": turn.assistant})
        return out

    def remember_answer(self, key: str, reply_payload: bytes) -> None:
        self.answered[key] = reply_payload
        self.answered.move_to_end(key)
        while len(self.answered) > ANSWERED_KEYS_PER_SESSION:
            self.answered.popitem(last=False)

    def reset(self) -> None:
        """Forget the conversation; keep the answered keys so an old redelivery is still
        recognised and never generates again."""
        self.turns.clear()
        self.system_prompt = None


def history_tokens(renderer: PromptRenderer, history: SessionHistory) -> int:
    """Exact tokens of the kept turns: the rendered conversation minus the system part."""
    if not history.turns:
        return 0
    full = len(renderer.render(history.messages(), add_generation_prompt=False))
    system_only = history.messages(turns=[])
    base = len(renderer.render(system_only, add_generation_prompt=False)) if system_only else 0
    return full - base


@dataclass(frozen=True)
class Trim:
    dropped_turns: int
    kept_turns: int
    tokens_before: int
    tokens_after: int


def trim_to_limits(renderer: PromptRenderer, history: SessionHistory, limits: HistoryLimits) -> Trim | None:
    """Once a limit is exceeded, drop the oldest turns until both are at most half their
    limit. Returns what was done, or None when nothing was dropped."""
    tokens = history_tokens(renderer, history)
    if len(history.turns) <= limits.max_turns and tokens <= limits.max_tokens:
        return None
    before, dropped = tokens, 0
    while history.turns and (len(history.turns) > limits.max_turns // 2 or tokens > limits.max_tokens // 2):
        history.turns.pop(0)
        dropped += 1
        tokens = history_tokens(renderer, history)
    return Trim(dropped, len(history.turns), before, tokens)


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    trims: tuple[Trim, ...]


def build_prompt(
    renderer: PromptRenderer,
    history: SessionHistory,
    user_message: str,
    *,
    limits: HistoryLimits,
    max_tokens: int,
    max_model_len: int,
) -> Prompt:
    """The token ids of history + the new user message, trimmed so that prompt + max_tokens
    fits the context. Raises RequestError(too_long) when even the bare message cannot fit."""
    trims: list[Trim] = []
    trim = trim_to_limits(renderer, history, limits)
    if trim:
        trims.append(trim)
    user: ChatMessage = {"role": "user", "content": user_message}
    while True:
        token_ids = renderer.render([*history.messages(), user], add_generation_prompt=True)
        if len(token_ids) + max_tokens <= max_model_len:
            return Prompt(token_ids, tuple(trims))
        if not history.turns:
            raise RequestError(
                ErrorCode.TOO_LONG,
                f"prompt of {len(token_ids)} tokens plus maxTokens {max_tokens} exceeds the "
                f"context of {max_model_len} tokens",
            )
        before = history_tokens(renderer, history)
        history.turns.pop(0)
        trims.append(Trim(1, len(history.turns), before, history_tokens(renderer, history)))


def split_reasoning(text: str, *, opened_in_prompt: bool = False) -> tuple[str, str | None]:
    """(answer, reasoning) of a generated text. Reasoning models write ``<think>...</think>``
    before the answer; the opening tag may be part of the prompt (QwQ's template adds it).
    A think block that never closes is all reasoning and no answer."""
    stripped = text.lstrip()
    opened = opened_in_prompt or stripped.startswith(THINK_OPEN)
    if THINK_CLOSE in text:
        reasoning, answer = text.split(THINK_CLOSE, 1)
        reasoning = reasoning.strip()
        if reasoning.startswith(THINK_OPEN):
            reasoning = reasoning[len(THINK_OPEN) :].lstrip()
        return answer.strip(), reasoning
    if opened:
        reasoning = stripped[len(THINK_OPEN) :] if stripped.startswith(THINK_OPEN) else stripped
        return "", reasoning.strip()
    return text, None


class SessionStore:
    """All live sessions, least recently used first; the oldest is forgotten beyond capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._sessions: OrderedDict[str, SessionHistory] = OrderedDict()

    def get(self, name: str) -> SessionHistory:
        history = self._sessions.get(name)
        if history is None:
            history = self._sessions[name] = SessionHistory()
        self._sessions.move_to_end(name)
        while len(self._sessions) > self.capacity:
            self._sessions.popitem(last=False)
        return history

    def peek(self, name: str) -> SessionHistory | None:
        """The session if it exists; neither creates nor refreshes it."""
        return self._sessions.get(name)

    def __len__(self) -> int:
        return len(self._sessions)

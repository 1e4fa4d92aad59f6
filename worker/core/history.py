"""Per-session chat history and the trimming that keeps prompts short and prefix-stable.

Token counts come from the model's own tokenizer and chat template (a ``PromptRenderer``),
never from characters. No I/O here.

Why trimming halves: vLLM reuses the KV cache of a prompt's longest cached prefix. Dropping
one old turn per message would shift the whole conversation every turn and make every turn
a cache miss; dropping down to half the limit keeps the prefix stable for several turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import EllipsisType
from typing import Any, Protocol

from ..protocol.messages import ErrorCode, RequestError
from ..session import THINK_CLOSE, THINK_OPEN, ChatMessage, Message, SessionHistory, template_form

Tools = Sequence[dict[str, Any]] | None  # the session's tools as the chat template takes them


class PromptRenderer(Protocol):
    """The model's chat template and tokenizer (see engine/tokenizer.py)."""

    opens_reasoning: bool  # the generation prompt opens <think> (QwQ-style templates)

    def render(
        self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool, tools: Tools = None
    ) -> list[int]: ...

    def encode(self, text: str) -> list[int]:
        """Text the model itself writes (a forced call's opening), as ids: added tokens such
        as <tool_call> become their ids."""
        ...

    def count_text(self, text: str) -> int: ...

    def decode(self, ids: Sequence[int]) -> str:
        """Generated ids as the engine writes them (special tokens skipped)."""
        ...

    def render_text(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool, tools: Tools = None) -> str:
        """The template's text that ``render`` encodes (a tool loop continues a prompt from it)."""
        ...

    @property
    def stop_token_ids(self) -> Sequence[int]:
        """Ids that end a generation (the engine's stop tokens)."""
        ...

    async def prepare(self, messages: Sequence[ChatMessage], tools: Tools = None) -> None:
        """Get ready to render these messages (with a generation prompt) soon: e.g. encode
        their new text off the event loop. render() must give the same ids either way."""

    def remember_reply(self, text: str, ids: Sequence[int]) -> None:
        """This reply (the text a turn keeps) was generated as these ids: a later prompt that
        writes it may encode it as them, which the engine's prefix cache holds."""


@dataclass(frozen=True)
class HistoryLimits:
    max_turns: int
    # What the kept turns may add to a prompt, in tokens (not a reply length: that is maxTokens).
    max_history_tokens: int


@dataclass(frozen=True)
class Trim:
    dropped_turns: int
    kept_turns: int
    tokens_before: int
    tokens_after: int


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    history_tokens: int  # what the kept turns add to this prompt
    trims: tuple[Trim, ...]


class _PromptRenderings:
    """Renders history + the current turn's messages (a new user message, or an open turn and
    its tool results), and what the history adds to it: the prompt with the kept turns minus
    the prompt without them (the system prompt, the tools and the current turn are not
    counted). One full render per request; trimming re-renders only when it drops turns."""

    def __init__(
        self,
        renderer: PromptRenderer,
        history: SessionHistory,
        current: Sequence[Message | ChatMessage],
        tools: list[dict[str, Any]] | EllipsisType | None = ...,
    ) -> None:
        self.renderer, self.history = renderer, history
        self.current = [template_form(m) for m in current]
        self.tools = history.tool_forms() if tools is ... else tools
        self._bare = self._render(history.messages(turns=[]))
        self.update()

    def _render(self, messages: list[ChatMessage]) -> list[int]:
        return self.renderer.render([*messages, *self.current], add_generation_prompt=True, tools=self.tools)

    def update(self) -> None:
        self.token_ids = self._render(self.history.messages()) if self.history.turns else self._bare
        self.history_tokens = len(self.token_ids) - len(self._bare)

    def drop_oldest(self, count: int = 1) -> None:
        del self.history.turns[:count]
        self.update()


def user_message(text: str) -> ChatMessage:
    """A user message in the template's form (a turn holds a ``UserMessage``)."""
    return {"role": "user", "content": text}


def history_tokens(renderer: PromptRenderer, history: SessionHistory, message: str = "") -> int:
    """Exact tokens the kept turns add to a prompt (see _PromptRenderings)."""
    return _PromptRenderings(renderer, history, [user_message(message)]).history_tokens


def build_prompt(
    renderer: PromptRenderer,
    history: SessionHistory,
    current: str | Sequence[Message | ChatMessage],
    *,
    limits: HistoryLimits,
    max_tokens: int,
    max_model_len: int,
    prefill: Sequence[int] = (),
    tools: list[dict[str, Any]] | EllipsisType | None = ...,
) -> Prompt:
    """The token ids of history + the current turn's messages (``history.turns`` holds the
    closed turns only), then ``prefill``: the start of the reply, written for the model (a
    forced call's opening), whose tokens count towards the context. A str is a new user
    message. ``tools``: the tools the template shows (default: the session's own; the tool
    loop adds the worker's).

    Once a history limit is exceeded, the oldest turns are dropped until both are at most half
    their limit; then more, if prompt + max_tokens would not fit the context. Raises
    RequestError(too_long) when even the bare message cannot fit."""
    prompt = _PromptRenderings(
        renderer, history, [user_message(current)] if isinstance(current, str) else current, tools
    )
    trims: list[Trim] = []
    turns = history.turns
    if len(turns) > limits.max_turns or prompt.history_tokens > limits.max_history_tokens:
        before, dropped = prompt.history_tokens, 0
        while turns and (len(turns) > limits.max_turns // 2 or prompt.history_tokens > limits.max_history_tokens // 2):
            prompt.drop_oldest()
            dropped += 1
        trims.append(Trim(dropped, len(turns), before, prompt.history_tokens))
    while len(prompt.token_ids) + len(prefill) + max_tokens > max_model_len:
        if not turns:
            raise RequestError(
                ErrorCode.TOO_LONG,
                f"prompt of {len(prompt.token_ids) + len(prefill)} tokens plus maxTokens {max_tokens} exceeds the "
                f"context of {max_model_len} tokens",
            )
        before = prompt.history_tokens
        prompt.drop_oldest()
        trims.append(Trim(1, len(turns), before, prompt.history_tokens))
    return Prompt([*prompt.token_ids, *prefill], prompt.history_tokens, tuple(trims))


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


def partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that is the start of tag (a tag split over deltas)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplitter:
    """Splits a generation's text, delta by delta, into reasoning and answer.

    When the prompt opened ``<think>`` (QwQ-style templates), the generation starts inside the
    reasoning: everything until ``</think>`` is reasoning. Otherwise the text is answer and goes
    out as it comes, so a model that does not think streams with no delay; only a possible
    ``<think>`` at the very start of the output (after leading whitespace) is held back, and
    only while it could still be that tag: ``"<thi"`` waits for the next delta, ``"<this"`` is
    released at once. Leading whitespace is never held. A ``</think>`` split over deltas is held
    until it is whole (it is reasoning either way). ``feed`` returns ``(is_reasoning, text)``
    parts in order."""

    def __init__(self, *, opened_in_prompt: bool) -> None:
        # start: the output may still open <think>; reasoning: inside the think block; answer.
        self.state = "reasoning" if opened_in_prompt else "start"
        self.opened = opened_in_prompt  # has the model reasoned (a think block was opened)?
        self._held = ""

    @property
    def reasoning(self) -> bool:
        """Inside the think block now."""
        return self.state == "reasoning"

    def feed(self, text: str) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        held = self._held + text
        while held:
            if self.state == "start":
                body = held.lstrip()
                if len(body) < len(held):
                    out.append((False, held[: len(held) - len(body)]))  # whitespace: answer now
                    held = body
                if not body:
                    break
                if body.startswith(THINK_OPEN):
                    self.state, held = "reasoning", body[len(THINK_OPEN) :]
                    self.opened = True
                elif THINK_OPEN.startswith(body):
                    break  # a partial "<think>": wait for the next delta
                else:
                    self.state = "answer"  # it cannot open a think block any more
            elif self.state == "reasoning":
                end = held.find(THINK_CLOSE)
                if end >= 0:
                    if end:
                        out.append((True, held[:end]))
                    self.state, held = "answer", held[end + len(THINK_CLOSE) :]
                    continue
                keep = partial_tag_suffix(held, THINK_CLOSE)
                if len(held) > keep:
                    out.append((True, held[: len(held) - keep]))
                held = held[len(held) - keep :]
                break
            else:
                out.append((False, held))
                held = ""
        self._held = held
        return out

    def flush(self) -> list[tuple[bool, str]]:
        """What is still held back, at the end of the generation."""
        held, self._held = self._held, ""
        if not held:
            return []
        return [(self.state == "reasoning", held)]

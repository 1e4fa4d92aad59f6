"""The model's tokenizer and chat template (transformers), as a PromptRenderer.

The worker renders prompts to token ids itself and hands the ids to the engine: the token
counts it trims by are then exactly the tokens the engine sees, and the engine does no
second tokenization.

Tokenizing is the costly part of a prompt (3 ms per 2,000 tokens with a 152k vocabulary,
against 0.03 ms for the template; it holds the GIL, on the event loop), and most of every
prompt is the same conversation as last turn's. A fast tokenizer splits out added tokens
(<|im_start|>, <|im_end|>, ...) before anything else and encodes the text between them
independently, so the text between added tokens is cached: a new turn encodes only its new
message and the last reply. Checked against whole-text encoding at start; a tokenizer for
which the two differ is encoded whole.

Even those two segments cost the loop: profiled on an H200 at 100 sessions, encoding took
12-20% of the event loop (the rest: vLLM's output processing, streaming, the store), and
the next turns of other sessions waited behind it. ``prepare`` encodes a turn's new segments
in a thread before the prompt is rendered: the Rust tokenizer releases the GIL while it
encodes, so the loop goes on streaming meanwhile. The turns that prepare at the same time
share that thread hop: their segments go in batches (``_encoding``). 1,000 first turns at once
(bench.intake --to-engine, SmolLM2's tokenizer, 2 cores) cost the event loop 0.96-1.08 ms each
instead of 1.41-1.45, and the last reached the engine after 1.32-1.35 s instead of 1.64-1.83.
A batch is bounded (ENCODE_BATCH_CHARS) and goes into the thread as soon as it is full: a burst
in one batch held its first turn until its last was encoded.

A reply goes back into the cache as the ids it was generated as (``remember_reply``).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

from loguru import logger

from ..session import THINK_OPEN, ChatMessage

Tools = Sequence[dict[str, Any]] | None

NO_ARGS = {"type": "object", "properties": {}}
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
SEGMENT_CACHE_SIZE = 8192
TOOLS_CACHE_SIZE = 64
# The template texts kept for a turn's second render: every request in flight renders once in
# prepare and again in build_prompt, and 1,000 requests at once all prepare before the first
# builds. Bounded in characters (each entry also costs a 16-byte key): 8M characters hold 1,000
# prompts of 2,000 tokens (about 8k characters each), 8-32 MiB.
RENDER_CACHE_CHARS = 8_000_000
ENCODE_BATCHES_IN_FLIGHT = 2  # prepare's batches of segments in threads at once (_encoding)
# A batch holds at most this many characters of segments (about 16k tokens) and starts as soon
# as it has them: the first turns of a burst reach the engine while later ones still render.
ENCODE_BATCH_CHARS = 65536
LONG_TEXT = 4096  # characters: count_text encodes a longer text without the GIL
_SELF_CHECK = [
    {"role": "system", "content": "You are terse.  Ünïcödé, 数字 123, emoji 🙂\n\n  spaces "},
    {"role": "user", "content": "<think>not really</think> hello\tworld\r\n"},
    {"role": "assistant", "content": " leading space, trailing newline\n"},
    {"role": "user", "content": "<|im_start|> inside text <|im_end|>?"},
]


class ChatTokenizer:
    def __init__(self, model: str) -> None:
        from transformers import AutoTokenizer  # heavy: imported only when a worker starts

        self._tokenizer: Any = AutoTokenizer.from_pretrained(model)
        # The Rust tokenizer itself: what transformers' encode calls, without its per-call
        # Python work, and safe to share with a thread since nothing here reconfigures it.
        self._backend: Any = self._tokenizer.backend_tokenizer
        if not getattr(self._tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of {model} has no chat template")
        self.stop_token_ids = self._stop_token_ids(model)
        generation_prompt = self._tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
        )
        # QwQ-style templates open the think block in the prompt itself.
        self.opens_reasoning = str(generation_prompt).rstrip().endswith(THINK_OPEN)
        # Control tokens written inside a message are text, not control: "<|im_end|>\n
        # <|im_start|>system\n..." in a user message would otherwise be encoded as the real
        # tokens (transformers and tokenizers match added tokens anywhere in the text) and
        # forge turns of the conversation. A zero-width space after their first character
        # keeps them readable and makes them plain text. Every added token, not only those
        # listed as special: the encoder matches the whole added vocabulary, and a saved
        # tokenizer may not list <|im_start|> (or <think>) as special.
        added = {str(k): int(v) for k, v in self._tokenizer.get_added_vocab().items()}
        controls = {t for t in [*self._tokenizer.all_special_tokens, *added] if len(t) > 1}
        specials = sorted(controls, key=len, reverse=True)
        self._special_in_text = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._added_ids = added
        self._added_id_set = frozenset(added.values())
        pattern = "|".join(re.escape(token) for token in sorted(added, key=len, reverse=True))
        self._splitter = re.compile(f"({pattern})") if pattern else None
        self._segments: OrderedDict[str, list[int]] = OrderedDict()
        # prepare's segments waiting to be encoded or being encoded, in batches (_encoding)
        self._encodings: dict[str, asyncio.Future[list[int]]] = {}
        self._queued: list[str] = []
        self._queued_chars = 0
        self._batches_in_flight = 0
        self._batch_scheduled = False
        self._batch_loop: asyncio.AbstractEventLoop | None = None  # the loop all of these belong to
        self._batches: set[asyncio.Future[Any]] = set()  # the batches in a thread
        self._tools_cache: OrderedDict[str, Any] = OrderedDict()
        self._renders: OrderedDict[Hashable, tuple[str, int]] = OrderedDict()  # _render_key: text, chars held
        self._render_chars = 0
        self._cache_segments = self._splitter is not None and self._segmented_matches_whole()
        if not self._cache_segments:
            logger.info("Tokenizer of {}: encoding whole prompts (segment cache does not match it)", model)
        self._reply_prefix = self._find_reply_prefix() if self._cache_segments else None

    def _stop_token_ids(self, model: str) -> list[int]:
        """End-of-turn tokens: eos, the generation config's eos ids, and known end markers.

        Stop *tokens*, not stop strings: with skip_special_tokens a special-token stop
        string never appears in the text and would never match."""
        ids: set[int] = set()
        if self._tokenizer.eos_token_id is not None:
            ids.add(int(self._tokenizer.eos_token_id))
        try:
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(model).eos_token_id
            ids.update([eos] if isinstance(eos, int) else list(eos or []))
        except OSError:
            pass  # no generation_config.json
        vocab = self._tokenizer.get_vocab()
        ids.update(vocab[token] for token in END_OF_TURN_TOKENS if token in vocab)
        return sorted(ids)

    def _template(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool, tools: Tools = None) -> str:
        # A turn renders the same messages twice (prepare, then build_prompt): the second finds
        # the first's text here. The template (jinja) was a fifth of the event loop's time per
        # request at intake (bench/intake.py --to-engine: 1,000 one-turn requests at once). One
        # slot was not enough: under a burst every request prepares before the first builds, so
        # each rendered twice (2,000 renders for 1,000 requests, 0.3 ms each, profiled on 2 cores).
        key = _render_key(messages, tools, add_generation_prompt)
        if key is not None:
            cached = self._renders.get(key)
            if cached is not None:
                self._renders.move_to_end(key)
                return cached[0]
        text = str(
            self._tokenizer.apply_chat_template(
                self.defuse(messages),
                tools=self._defused_tools(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        )
        # Bounded by the characters held: the text, and the key's own strings (a key holds its
        # messages' texts, which a template may leave out: a past turn's reasoning).
        held = len(text) + (sum(len(v) for m in key[1:] for _, v in m) if isinstance(key, tuple) else 0)
        if key is not None and held <= RENDER_CACHE_CHARS:
            self._renders[key] = (text, held)
            self._render_chars += held
            while self._render_chars > RENDER_CACHE_CHARS:
                _, (_, dropped) = self._renders.popitem(last=False)
                self._render_chars -= dropped
        return text

    def _defused_tools(self, tools: Sequence[dict[str, Any]]) -> Any:
        """The tools, defused, from a small cache keyed by their JSON text: a session's tools
        are the same request after request, and walking 20 tools' schemas cost 0.5 ms per render
        (three renders a request) against 0.1 ms for their JSON text."""
        key = json.dumps(tools, sort_keys=True, ensure_ascii=False)
        defused = self._tools_cache.get(key)
        if defused is None:
            defused = self._tools_cache[key] = self.defuse_value(list(tools))
            if len(self._tools_cache) > TOOLS_CACHE_SIZE:
                self._tools_cache.popitem(last=False)
        else:
            self._tools_cache.move_to_end(key)
        return defused

    def defuse(self, messages: Sequence[ChatMessage]) -> list[ChatMessage]:
        """The messages with every special token in their text made plain text (see __init__):
        the content, and the strings inside tool calls' arguments and a tool result's name."""
        if self._special_in_text is None:
            return list(messages)
        return [self.defuse_value(m) for m in messages]

    def defuse_value(self, value: Any) -> Any:
        """A JSON value (a message, a tool) with special tokens in its strings made text; the
        value itself when it has none (no copy)."""
        pattern = self._special_in_text
        if pattern is None:
            return value
        if isinstance(value, str):
            return pattern.sub(_break_token, value) if pattern.search(value) else value
        if isinstance(value, dict):
            items = {k: self.defuse_value(v) for k, v in value.items()}
            return value if all(items[k] is value[k] for k in value) else items
        if isinstance(value, list):
            values = [self.defuse_value(v) for v in value]
            return value if all(a is b for a, b in zip(values, value, strict=True)) else values
        return value

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool, tools: Tools = None) -> list[int]:
        return self.encode(self._template(messages, add_generation_prompt=add_generation_prompt, tools=tools))

    def render_text(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool, tools: Tools = None) -> str:
        """What ``render`` encodes: the template's text of the messages (defused)."""
        return self._template(messages, add_generation_prompt=add_generation_prompt, tools=tools)

    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer (vLLM's tool parsers take it)."""
        return self._tokenizer

    def tool_support(self) -> tuple[bool, str | None]:
        """(whether the chat template renders tools and a tool round, the vLLM tool parser its
        call format matches: hermes for <tool_call> markup, llama3_json for Llama 3's JSON
        calls, None when neither). A template that ignores ``tools`` cannot offer them to the
        model: requests with tools are refused rather than silently dropped."""
        probe = {"type": "function", "function": {"name": "probe_tool_x", "description": "d", "parameters": NO_ARGS}}
        call = {"id": "call_1", "type": "function", "function": {"name": "probe_tool_x", "arguments": {"a": 1}}}
        round_: list[ChatMessage] = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "name": "probe_tool_x", "content": "result_y"},
        ]
        try:
            offered = self._template(round_[:1], add_generation_prompt=True, tools=[probe])
            rendered = self._template(round_, add_generation_prompt=True, tools=[probe])
        except Exception as exc:  # a template that fails on tools or tool messages: no tools
            logger.debug("The chat template cannot render a tool round: {}", exc)
            return False, None
        if "probe_tool_x" not in offered or "result_y" not in rendered:
            return False, None
        if "<tool_call>" in rendered:
            return True, "hermes"
        if '"parameters"' in rendered and "<|eot_id|>" in rendered:
            return True, "llama3_json"
        return True, None

    async def prepare(self, messages: Sequence[ChatMessage], tools: Tools = None) -> None:
        """Encode the segments of these messages' prompt that are not cached yet, in a thread
        (see the module's docstring); render() then finds them cached."""
        if not self._cache_segments:
            return
        assert self._splitter is not None
        parts = self._splitter.split(self._template(messages, add_generation_prompt=True, tools=tools))
        missing = list(dict.fromkeys(p for i, p in enumerate(parts) if i % 2 == 0 and p and p not in self._segments))
        if missing:
            waits = [self._encoding(part) for part in missing]
            # Not gather: a cancelled prepare must not cancel what other turns wait for too.
            await asyncio.wait(waits)
            # Each one's outcome taken (a failure left untaken is logged when collected); the
            # ids are remembered by the batch.
            failures = [wait.exception() for wait in waits]
            for failure in failures:
                if failure is not None:
                    raise failure

    def _encoding(self, part: str) -> asyncio.Future[list[int]]:
        """The ids of ``part``, from the next batch of segments encoded in a thread.

        One thread hop per batch, not per turn: in a burst of first turns each hop cost the
        event loop more than its encoding (13% of the loop's time per request at intake, the
        chat template 30%; bench.intake --to-engine, SmolLM2's tokenizer, 2 cores), and the
        Rust tokenizer spreads a batch over the cores itself. At most ENCODE_BATCHES_IN_FLIGHT
        batches are in a thread at once; what comes meanwhile waits for the next, so batches
        grow with the load and one turn alone still takes a single hop."""
        loop = asyncio.get_running_loop()
        if loop is not self._batch_loop:  # (tests and benchmarks run one tokenizer in several loops)
            self._batch_loop, self._encodings, self._queued, self._queued_chars = loop, {}, [], 0
            self._batches_in_flight, self._batch_scheduled = 0, False
        waiting = self._encodings.get(part)
        if waiting is None:
            waiting = self._encodings[part] = loop.create_future()
            self._queued.append(part)
            self._queued_chars += len(part)
            if self._queued_chars >= ENCODE_BATCH_CHARS:
                self._start_batch()  # a full batch goes now, not after the rest of this loop pass
            if self._queued and not self._batch_scheduled:  # at the end of this pass: what else comes joins
                self._batch_scheduled = True
                loop.call_soon(self._scheduled_batch)
        return waiting

    def _scheduled_batch(self) -> None:
        self._batch_scheduled = False
        self._start_batch()

    def _start_batch(self) -> None:
        """Start batches of what is queued, each of at most ENCODE_BATCH_CHARS characters (or
        one segment), while fewer than ENCODE_BATCHES_IN_FLIGHT are in a thread.

        Bounded because a batch is answered whole: 1,000 first turns at once made one batch of
        1,000 segments, and the first turn reached the engine only when the last was encoded
        (bench.intake --to-engine, 2 cores: the first at 1.04 s of 1.1)."""
        while self._queued and self._batches_in_flight < ENCODE_BATCHES_IN_FLIGHT:
            size = count = 0
            for part in self._queued:
                if count and size + len(part) > ENCODE_BATCH_CHARS:
                    break
                size += len(part)
                count += 1
            parts, self._queued = self._queued[:count], self._queued[count:]
            self._queued_chars -= size
            self._batches_in_flight += 1
            # Into the thread now (run_in_executor submits at once; a task would start only
            # after every turn ready on the loop ahead of it): the Rust tokenizer releases the
            # GIL while it encodes, so the loop renders the next turns meanwhile.
            assert self._batch_loop is not None
            encoding = self._batch_loop.run_in_executor(
                None, functools.partial(self._backend.encode_batch, parts, add_special_tokens=False)
            )
            self._batches.add(encoding)
            encoding.add_done_callback(functools.partial(self._batch_done, parts))

    def _batch_done(self, parts: list[str], encoding: asyncio.Future[Any]) -> None:
        # On the loop: the thread only encodes; the cache and the futures are touched here alone.
        self._batches.discard(encoding)
        try:
            failure = RuntimeError("the encoding was cancelled") if encoding.cancelled() else encoding.exception()
            if failure is not None:  # the waiters' to raise
                self._fail(parts, failure if isinstance(failure, Exception) else RuntimeError(str(failure)))
                return
            for part, encoded in zip(parts, encoding.result(), strict=True):
                ids = self._remember(part, list(encoded.ids))
                waiting = self._encodings.pop(part, None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(ids)
        finally:
            self._batches_in_flight -= 1
            self._start_batch()

    def decode(self, ids: Sequence[int]) -> str:
        # As the engine detokenizes a generation (skip_special_tokens in engine/vllm.py).
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))

    def encode(self, text: str) -> list[int]:
        if not self._cache_segments:
            return list(self._tokenizer.encode(text, add_special_tokens=False))
        return self._encode_segmented(text)

    def _encode_segmented(self, text: str) -> list[int]:
        assert self._splitter is not None
        ids: list[int] = []
        for index, part in enumerate(self._splitter.split(text)):
            if index % 2:  # an added token
                ids.append(self._added_ids[part])
            elif part:
                cached = self._segments.get(part)
                if cached is None:
                    cached = self._remember(part, list(self._backend.encode(part, add_special_tokens=False).ids))
                else:
                    self._segments.move_to_end(part)
                ids.extend(cached)
        return ids

    def _remember(self, part: str, ids: list[int]) -> list[int]:
        self._segments[part] = ids
        if len(self._segments) > SEGMENT_CACHE_SIZE:
            self._segments.popitem(last=False)
        return ids

    def remember_reply(self, text: str, ids: Sequence[int]) -> None:
        """This reply was generated as these ids: where the next turn's prompt writes it as
        generated, it is encoded as them, not as the tokenizer would split its text.

        The engine's prefix cache holds the ids the model chose, and a model need not choose
        the tokenizer's split: on the Qwen3-VL-2B geometry (dummy weights) no second turn found
        its first reply's blocks, which capped the second turn's hit at 0.895 with an image of
        768 tokens and a 32-token reply. The reply is the text after the generation prompt's
        last added token ("assistant\n" in ChatML) up to the end of the turn, one segment of
        the segment cache: the segment is remembered with the generated ids. Only where they
        decode to exactly this text (a reply whose reasoning was cut, or that a stop string
        ended, does not) and hold no added token; a template that rewrites replies never
        writes the segment, and the entry goes unused."""
        prefix = self._reply_prefix
        if prefix is None or not text:
            return
        generated = list(ids)
        while generated and generated[-1] in self.stop_token_ids:
            generated.pop()  # the end of the turn: the template writes its own
        if not generated or not self._added_id_set.isdisjoint(generated) or self.decode(generated) != text:
            return
        self._remember(prefix + text, [*self._encode_segmented(prefix), *generated])

    def _find_reply_prefix(self) -> str | None:
        """The text of the generation prompt after its last added token, where the template
        writes a reply of the history right after it ("assistant\n" + reply in ChatML); None
        where it does not (QwQ's prompt opens <think>, which the history's replies lack)."""
        assert self._splitter is not None
        user: ChatMessage = {"role": "user", "content": "x"}
        reply = "A reply written as given 42."
        opened = self._splitter.split(self._template([user], add_generation_prompt=True))
        written = self._splitter.split(
            self._template(
                [user, {"role": "assistant", "content": reply}, {"role": "user", "content": "y"}],
                add_generation_prompt=True,
            )
        )
        prefix = opened[-1]
        return prefix if prefix + reply in written[::2] else None

    def _fail(self, parts: list[str], exc: Exception) -> None:
        for part in parts:
            waiting = self._encodings.pop(part, None)
            if waiting is not None and not waiting.done():
                waiting.set_exception(exc)

    def _segmented_matches_whole(self) -> bool:
        for add_generation_prompt in (False, True):
            text = str(
                self._tokenizer.apply_chat_template(
                    _SELF_CHECK, add_generation_prompt=add_generation_prompt, tokenize=False
                )
            )
            whole = list(self._tokenizer.encode(text, add_special_tokens=False))
            if self._encode_segmented(text) != whole:
                return False
        self._segments.clear()
        return True

    def count_text(self, text: str) -> int:
        """Safe in a thread (the turn counts a tool result's tokens in one). A long text is
        counted with encode_batch, which gives up the GIL while it encodes: encode keeps it,
        and 40,000 characters held the event loop for 140 ms on a busy 2-core machine."""
        if self._special_in_text is not None:
            text = self._special_in_text.sub(_break_token, text)
        if len(text) > LONG_TEXT:
            return len(self._backend.encode_batch([text], add_special_tokens=False)[0].ids)
        return len(self._backend.encode(text, add_special_tokens=False).ids)


def _render_key(messages: Sequence[ChatMessage], tools: Tools, add_generation_prompt: bool) -> Hashable | None:
    """What a render is remembered by: exactly its input, so equal keys render the same text.

    Messages whose values are all strings (chat turns) and no tools: the strings themselves,
    in a tuple. Python keeps a string's hash, so a lookup hashes a few pointers and compares
    the texts only on a hit: 0.5 us, where the messages' JSON text digested took 17 us (a
    1,700-character message, 2 cores), twice a request. Anything else (tool calls, content
    parts, tools): the JSON text, digested; None where that fails (rendered every time)."""
    if not tools:
        plain: list[tuple[tuple[str, Any], ...]] = []
        for message in messages:
            if not all(type(value) is str for value in message.values()):
                break
            plain.append(tuple(message.items()))
        else:
            return (add_generation_prompt, *plain)
    try:
        text = json.dumps([messages, tools, add_generation_prompt], ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError):
        return None
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _break_token(match: re.Match[str]) -> str:
    token = match.group(0)
    return token[0] + "\u200b" + token[1:]

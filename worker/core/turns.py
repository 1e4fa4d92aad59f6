"""One turn of a session: prompt, generation, streaming, reply.

The service decides *whether* and *when* a request runs (validation, admission, per-session
order); the TurnRunner runs it. ``run`` sets the session's system prompt and tools from the
request, then hands over to the request's tool rounds (core/rounds.py: the loop that
generates, runs the worker's own calls and generates again, until no call is left
unanswered). Each generation of the loop comes back here: ``generate`` builds the trimmed
prompt from the session's history and the turn so far (core/history.py), decides what the
model may call (core/calls.py), streams the engine's output (publishing deltas when asked),
and checks the calls it makes; ``reply`` builds the reply with its token counts and latencies.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from loguru import logger

from ..config.models import GenerationConfig, ToolsConfig, VisionConfig
from ..engine.port import (
    Engine,
    EngineDead,
    EngineError,
    EngineImage,
    GenerationRequest,
    GenerationUpdate,
    ImagesRejected,
    SamplingOptions,
    StructuredOutput,
    StructuredOutputRejected,
    ToolParser,
    ToolSupport,
)
from ..protocol.images import ImageInput
from ..protocol.messages import (
    REASONING_BUDGET,
    TOOL_CALLS,
    ChatReply,
    ChatRequest,
    ErrorCode,
    JsonSchemaFormat,
    Latency,
    RequestError,
    Usage,
    check_request_schemas,
    has_schemas,
    log_ref,
)
from ..protocol.topics import SessionAddress, Topics
from ..schemacheck import grammar_document
from ..session import THINK_CLOSE, ImageRef, Message, SessionHistory, StoredImage, ToolSpec, Turn, UserMessage
from ..tools.port import Toolbox
from ..transport.port import Publisher
from ..vision.topics import unknown_topic
from .calls import (
    MarkupHold,
    ToolPlan,
    call_key,
    check_calls,
    escape_raw_controls,
    forced_call_schema,
    plan_tools,
    specs_from_request,
)
from .history import HistoryLimits, PromptRenderer, ReasoningSplitter, build_prompt, split_reasoning
from .pending import Continuation, Generated, PendingTurn, TurnAnswer, ms_between, wire_calls
from .rounds import ToolRounds, start_rounds
from .stats import StatsCollector
from .stream import DeltaStream
from .worker_calls import ProgressJournal, WorkerCalls

# How an image's bytes become what the engine takes (EngineImage.pixels): the vision
# adapter's decoder (worker/vision/images.py: bounded, RGB), run on a thread. The default
# hands the bytes on as they are, for engines that take bytes (the tests' fake engine).
ImageDecoder = Callable[[bytes, str], Any]


def keep_bytes(data: bytes, where: str) -> Any:
    return data


class ImageSource(Protocol):
    """Where a request's ``imageTopics`` are read (worker/vision/topics.py VisionTopics)."""

    async def images(self, user: str, topics: Sequence[str]) -> list[ImageInput]: ...


def structured_output(request: ChatRequest) -> StructuredOutput | None:
    """The engine's form of the request's responseFormat (None: free text)."""
    if request.response_format is None:
        return None
    if isinstance(request.response_format, JsonSchemaFormat):
        # References rewritten to plain #/$defs/<name>: the grammar backend resolves neither
        # escaped pointers (~1, %20) nor anchors (schemacheck.grammar_schema).
        return StructuredOutput(json_schema=grammar_document(request.response_format.json_schema))
    return StructuredOutput()


def reasoning_budget(request: ChatRequest, generation: GenerationConfig, *, structured: bool = False) -> int:
    """The request's thinking budget in tokens (0: none): its maxReasoningTokens capped by the
    configured max_reasoning_tokens, else that. Structured output (a responseFormat, a forced
    call) has no think block."""
    if structured:
        return 0
    configured, asked = generation.max_reasoning_tokens, request.max_reasoning_tokens
    if asked is None:
        return configured
    return min(asked, configured) if configured else asked


@dataclass(frozen=True)
class _Plan:
    """What one generation may do: the tools shown (``specs``), what the model may call
    (``choice``: the request's toolChoice for this round), the parser of its calls, the start
    of the reply written for it (a forced call's opening), and the grammar of its output."""

    specs: list[ToolSpec]
    choice: ToolPlan
    parser: ToolParser | None
    prefill: str = ""
    structured: StructuredOutput | None = None

    def hold(self, final: bool) -> MarkupHold | None:
        """What keeps call markup out of the stream: where calls may be made, and in the last
        round, whose calls are not taken either."""
        form = self.parser.format if self.parser is not None else None
        if form is not None and (self.choice.offered or (final and self.specs)):
            return MarkupHold(form)
        return None


class _Reader:
    """A generation's text as it comes: split into reasoning and answer (free text only),
    published to the stream (the reasoning only with includeReasoning), with call markup held
    back from the answer's deltas (``hold``)."""

    def __init__(
        self, stream: DeltaStream | None, hold: MarkupHold | None, splitter: ReasoningSplitter | None, show: bool
    ) -> None:
        self.stream, self.hold, self.splitter, self.show = stream, hold, splitter, show
        self.parts: list[str] = []

    def feed(self, delta: str) -> None:
        self.parts.append(delta)
        self._publish(self.splitter.feed(delta) if self.splitter else [(False, delta)])

    def finish(self) -> str:
        """The end of the generation: what was held goes out; the whole text."""
        if self.stream:
            if self.splitter:
                self._publish(self.splitter.flush())
            if self.hold is not None and (rest := self.hold.flush()):
                self.stream.add(rest)
            self.stream.flush()
        return "".join(self.parts)

    def _publish(self, pieces: list[tuple[bool, str]]) -> None:
        if self.stream is None:
            return
        for is_reasoning, text in pieces:
            if self.show or not is_reasoning:
                if self.hold is not None and not is_reasoning:
                    text = self.hold.feed(text)
                if text:
                    self.stream.add(text, reasoning=is_reasoning)


class TurnRunner:
    """Runs a request's turn on a draft of its session: the session's settings from the
    request, the tool rounds (core/rounds.py), and for each round the prompt, the engine's
    generation with its stream, and the calls checked; then the reply.

    ``tool_support``: the parser of the model's calls (None: no tool calling); ``toolbox``:
    the worker's own tools, run within ``tool_limits`` ([tools]); ``journal``: where a
    request's tool-loop progress is kept; ``call_scope``: what makes the ids of this worker's
    calls its own among workers (the topic prefix and the share group, or the worker id: see
    core/calls.py ``call_key``)."""

    def __init__(
        self,
        *,
        engine: Engine,
        renderer: PromptRenderer,
        generation: GenerationConfig,
        limits: HistoryLimits,
        default_system_prompt: str | None,
        topics: Topics,
        publisher: Publisher,
        stats: StatsCollector,
        engine_died: Callable[[int], None],
        tool_support: ToolSupport | None = None,
        max_tool_result_bytes: int = 65536,
        toolbox: Toolbox | None = None,
        tool_limits: ToolsConfig | None = None,
        journal: ProgressJournal | None = None,
        call_scope: str = "",
        vision_topics: ImageSource | None = None,
        vision: VisionConfig | None = None,
        decode_image: ImageDecoder = keep_bytes,
        user_image_bytes: Callable[[str, str], int] | None = None,
    ) -> None:
        self.engine = engine
        self.vision_topics = vision_topics
        self.vision = vision or VisionConfig()
        self.decode_image = decode_image
        # (user, session name) -> the bytes of images the user's other sessions store
        self.user_image_bytes = user_image_bytes
        self.renderer = renderer
        self.generation = generation
        self.limits = limits
        self.default_system_prompt = default_system_prompt
        self.topics = topics
        self.publisher = publisher
        self.stats = stats
        self._engine_died = engine_died
        self._ids = itertools.count(1)
        self.tool_support = tool_support or ToolSupport()
        self.max_tool_result_bytes = max_tool_result_bytes  # a client's tool result ([limits])
        self.tool_limits = tool_limits or ToolsConfig()
        self.worker_calls = WorkerCalls(
            toolbox, self.tool_limits, stats, lambda text: self.renderer.count_text(text), journal
        )
        self.call_scope = call_scope
        self.worker_calls.takes_images = engine.info.vision is not None
        self._think_close: int | None = None  # the id of THINK_CLOSE as one token (-1: none), once known

    @property
    def toolbox(self) -> Toolbox | None:
        return self.worker_calls.toolbox

    def call_key(self, turn: PendingTurn) -> str:
        """What the ids of the request's calls derive from (core/calls.py ``call_key``)."""
        return call_key(self.call_scope, str(turn.address), turn.key)

    def delta_stream(self, turn: PendingTurn) -> DeltaStream:
        interval = self.generation.stream_interval_ms / 1000
        return DeltaStream(self.publisher, self.topics.stream(turn.address), turn.key, interval)

    async def run(self, turn: PendingTurn, history: SessionHistory) -> TurnAnswer:
        """Answer the request on ``history``, a draft of the session (its system prompt, tools,
        trimming and the new turn or tool round go there): generate, and while the model calls
        the worker's own tools, run them and generate again (the tool loop, docs/tools.md).
        The reply and the draft to commit. RequestError: refused; the caller drops the draft."""
        address, request = turn.address, turn.request
        if turn.deadline is not None and time.monotonic() > turn.deadline:
            waited = time.monotonic() - turn.message.received_at
            raise RequestError(ErrorCode.EXPIRED, f"the request expired after waiting {waited:.1f}s for its turn")
        if request.system_prompt is not None:
            history.system_prompt = request.system_prompt
        elif history.system_prompt is None:
            history.system_prompt = self.default_system_prompt
        if request.tools and self.tool_support.unsupported is not None:
            raise RequestError(ErrorCode.INVALID_REQUEST, self.tool_support.unsupported)
        if has_schemas(request):  # seconds of CPU for a large payload of them: off the loop
            await asyncio.to_thread(check_request_schemas, request)
        if request.tools is not None:
            history.tools = specs_from_request(request.tools)
        if request.worker_tools is not None:
            history.worker_tools = self.worker_calls.choose(request.worker_tools, address.user)
        images = await self._take_images(turn, history)
        return await start_rounds(self, turn, history, images)

    async def _take_images(self, turn: PendingTurn, history: SessionHistory) -> tuple[ImageRef, ...]:
        """The request's images (its own, then its topics' latest), their bytes added to the
        draft's images by content hash (hashed on a thread: megabytes)."""
        request = turn.request
        inputs = list(request.image_inputs)
        if request.image_topics:
            if self.vision_topics is None:  # none configured: the words of a topic not allowed
                raise unknown_topic("imageTopics.0", request.image_topics[0])
            inputs += await self.vision_topics.images(turn.address.user, request.image_topics)
        if not inputs:
            return ()
        await asyncio.to_thread(lambda: [image.sha256 for image in inputs])
        for image in inputs:
            history.images.setdefault(image.sha256, StoredImage(image.data, image.media_type))
        return tuple(ImageRef(image.sha256, image.media_type, image.offset) for image in inputs)

    def _fit_images(self, history: SessionHistory, messages: Sequence[Message], address: SessionAddress) -> None:
        """The [vision] limits on the prompt's images: the oldest turns are dropped until the
        kept history's images and the turn's fit max_images_in_prompt (like tokens); the
        session's images, counted once each, and their bytes must fit the session's limits,
        else invalid_request (the session unchanged)."""
        current = Turn("", list(messages)).images()
        vision = self.vision
        if len(current) > vision.max_images_in_prompt:
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                f"the turn has {len(current)} images; a prompt may hold {vision.max_images_in_prompt}",
            )
        dropped = 0
        while history.turns and len(history.image_refs()) + len(current) > vision.max_images_in_prompt:
            del history.turns[0]
            dropped += 1
        if dropped:
            logger.info("Dialog trimmed for images: dropped={} kept={}", dropped, len(history.turns))
        refs = {ref.sha256: ref for ref in [*history.image_refs(), *current]}
        if len(refs) > vision.max_images_per_session:
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                f"the session would hold {len(refs)} images; the limit is {vision.max_images_per_session} "
                "(reset the session to start again)",
            )
        stored = sum(len(history.images[sha].data) for sha in refs if sha in history.images)
        if stored > vision.max_stored_bytes_per_session:
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                f"the session's images would take {stored} bytes; the limit is "
                f"{vision.max_stored_bytes_per_session} (reset the session to start again)",
            )
        if self.user_image_bytes is not None:
            elsewhere = self.user_image_bytes(address.user, str(address))
            if elsewhere + stored > vision.max_stored_bytes_per_user:
                raise RequestError(
                    ErrorCode.INVALID_REQUEST,
                    f"the images of {address.user!r}'s sessions would take {elsewhere + stored} bytes; the limit "
                    f"is {vision.max_stored_bytes_per_user} (reset a session to make room)",
                )

    async def _engine_images(self, history: SessionHistory, messages: Sequence[Message]) -> tuple[EngineImage, ...]:
        """The prompt's images in prompt order (the kept turns', then the turn's), each
        identified by its content hash: every turn sends the same image with the same
        identifier, so the engine's prefix cache covers earlier turns' images. Decoded on a
        thread."""
        refs = [*history.image_refs(), *Turn("", list(messages)).images()]
        if not refs:
            return ()
        missing = [ref.sha256 for ref in refs if ref.sha256 not in history.images]
        if missing:
            raise RequestError(
                ErrorCode.SESSION_UNREADABLE,
                "an image of this session's history is missing from its store; reset the session",
            )
        data = [(history.images[ref.sha256].data, ref.sha256) for ref in refs]

        def decode() -> list[Any]:
            return [self.decode_image(raw, f"image {sha[:12]}") for raw, sha in data]

        try:
            pixels = await asyncio.to_thread(decode)
        except ValueError as exc:  # the decoder's refusal (a bad image): its words
            raise RequestError(ErrorCode.INVALID_REQUEST, str(exc)[:500]) from None
        return tuple(EngineImage(p, ref.sha256) for p, ref in zip(pixels, refs, strict=True))

    def _plan(self, rounds: ToolRounds, *, final: bool) -> _Plan:
        """What the round's generation may call, and how a forced call is written."""
        request = rounds.pending.request
        specs = [*rounds.history.tools, *(tool.spec() for tool in rounds.worker.values())]
        choice = plan_tools(request, specs, round_in_request=rounds.rounds, final=final)
        structured = structured_output(request) if rounds.rounds == 0 else None
        parser = self.tool_support.parser
        if choice.offered and parser is None:
            unsupported = self.tool_support.unsupported or "tool calling is not available"
            raise RequestError(ErrorCode.INVALID_REQUEST, unsupported)
        if not choice.forced:
            return _Plan(specs, choice, parser, structured=structured)
        assert parser is not None
        if parser.format is None:
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                f"toolChoice 'required' or a named tool needs a known call format; the {parser.name} tool "
                "parser has none in this worker (use toolChoice 'auto')",
            )
        # The reply opens with the call itself, written for the model in its own format, and
        # the grammar constrains the call's JSON: the call always parses, and the stored
        # history renders as the model was trained. A prompt that opened a think block has it
        # closed first (a forced call does not think).
        prefill = (f"{THINK_CLOSE}\n\n" if self.renderer.opens_reasoning else "") + parser.format.open
        grammar = StructuredOutput(json_schema=forced_call_schema(choice.forced, parser.format))
        return _Plan(specs, choice, parser, prefill, grammar)

    async def _prompt(self, rounds: ToolRounds, plan: _Plan, max_tokens: int) -> tuple[list[int], str]:
        """The round's prompt: its token ids, and its text where a later round may continue it."""
        history, messages = rounds.history, rounds.turn.messages
        if history.images or any(isinstance(m, UserMessage) and m.images for m in messages):
            self._fit_images(history, messages, rounds.pending.address)
        tools = [spec.template_form() for spec in plan.specs] or None
        await self.renderer.prepare([*history.messages(), *(m.template_form() for m in messages)], tools)
        prefill_ids = self.renderer.encode(plan.prefill) if plan.prefill else []
        prompt = build_prompt(
            self.renderer,
            history,
            messages,
            limits=self.limits,
            max_tokens=max_tokens,
            max_model_len=self.engine.info.max_model_len,
            prefill=prefill_ids,
            tools=tools,
        )
        token_ids = prompt.token_ids
        # The text is needed only where a generation of the loop continues or may be continued:
        # a request whose calls all go to the client ends after its one generation.
        prompt_text = ""
        if (plan.choice.offered and rounds.worker) or rounds.previous is not None:
            forms = [*history.messages(), *(m.template_form() for m in messages)]
            prompt_text = self.renderer.render_text(forms, add_generation_prompt=True, tools=tools)
        if rounds.previous is not None and not prompt.trims:
            spliced = self._continuation(rounds.previous, prompt_text)
            if spliced is not None:
                token_ids = [*spliced, *prefill_ids]
        for trim in prompt.trims:
            logger.info(
                "Dialog trimmed: session={} dropped={} kept={} tokens {} -> {}",
                rounds.pending.address,
                trim.dropped_turns,
                trim.kept_turns,
                trim.tokens_before,
                trim.tokens_after,
            )
        return token_ids, prompt_text

    async def generate(self, rounds: ToolRounds, *, final: bool) -> Generated:
        """One generation of the loop: the prompt (history, the turn so far), the engine's
        stream, and the calls the reply makes, checked. ``final``: the last round the request
        may run, where calls are not taken."""
        turn, request, generation = rounds.pending, rounds.pending.request, self.generation
        plan = self._plan(rounds, final=final)
        max_tokens = request.max_tokens or generation.max_tokens
        token_ids, prompt_text = await self._prompt(rounds, plan, max_tokens)
        images = await self._engine_images(rounds.history, rounds.turn.messages)
        sampling = SamplingOptions(
            max_tokens=max_tokens,
            temperature=generation.temperature if request.temperature is None else request.temperature,
            top_p=generation.top_p if request.top_p is None else request.top_p,
            stop=tuple(generation.stop),
            structured=plan.structured,
        )
        if turn.key in turn.runtime.cancelled:
            # Cancelled while queued, or while its prompt was prepared (an await): checked here,
            # since from here on to the engine nothing awaits, and _stream marks it running,
            # where a cancel aborts it. No turn: the session stays as it was.
            return Generated(submitted=time.monotonic(), finish_reason="cancelled")
        if rounds.rounds == 0 and not rounds.generated:
            logger.debug("Request {} of {}: {!r}", turn.key, turn.address, request.message or request.tool_results)
        budget = reasoning_budget(request, generation, structured=plan.structured is not None)
        stream = None if plan.choice.forced else rounds.stream  # a forced reply is all call: no text to stream
        generated = await self._stream(
            turn,
            GenerationRequest(
                # vLLM logs request ids (an abort at INFO): the escaped request id, as in the worker's log.
                f"{turn.address}/{log_ref(turn.key)}/{next(self._ids)}",
                token_ids,
                sampling,
                images,
                # Nothing reads the text as it comes: no stream, no thinking budget to stop at.
                incremental=stream is not None or budget > 0,
            ),
            budget,
            stream=stream,
            hold=plan.hold(final),
        )
        rounds.previous = None
        if prompt_text:
            seen = prompt_text + plan.prefill
            forced = bool(plan.choice.forced)
            rounds.previous = Continuation(token_ids, seen, generated.raw_text, generated.token_ids, forced=forced)
        generated.text = self._answer(plan, generated, request)
        logger.debug("Reply {} of {}: {!r}", turn.key, turn.address, generated.text)
        if generated.finish_reason == "cancelled":
            return generated
        if plan.choice.offered:
            self._take_calls(turn, plan.choice, generated, plan.specs, round_=rounds.turn.rounds)
        elif final and plan.specs and plan.parser is not None:
            self._drop_late_calls(turn, generated, plan.specs)
        if not generated.tool_calls:
            self.renderer.remember_reply(generated.text, generated.token_ids)
        return generated

    def _answer(self, plan: _Plan, generated: Generated, request: ChatRequest) -> str:
        """The generated text as the answer: a forced call in the model's own markup; free
        text without its think block (kept in ``reasoning`` when the request asked for it)."""
        if plan.choice.forced:
            assert plan.parser is not None and plan.parser.format is not None
            form = plan.parser.format
            return form.open + escape_raw_controls(generated.text) + form.close
        if plan.structured is None:
            answer, reasoning = split_reasoning(generated.text, opened_in_prompt=self.renderer.opens_reasoning)
            if request.include_reasoning:
                generated.reasoning = reasoning  # in the reply only: the history keeps the answer
            return answer
        # The grammar constrains the reply from its first token: there is no think block to
        # remove, and "</think>" inside a JSON string (or a prompt that opened <think>) must
        # not cut the JSON.
        return generated.text

    def _continuation(self, previous: Continuation, prompt_text: str) -> list[int] | None:
        """The prompt of the loop's next generation as the previous prompt plus the ids it
        generated, plus the rest (the call's closing markup, the results) encoded: the prefix
        cache then holds all of it. Re-encoding the generated text instead can split it into
        other tokens than the model chose (a grammar lets a random-weights model pick any
        split: on the QwQ-32B geometry, 33 of 48 continuations lost the cache from the call's
        first token). None, for the prompt as rendered, where the text does not continue the
        previous generation as generated (the template rewrote it), or the ids are unknown."""
        generated = previous.generated_ids
        if not generated or not prompt_text.startswith(previous.prompt_text):
            return None
        rest = len(previous.prompt_text) + len(previous.generated_text)
        if not prompt_text.startswith(previous.generated_text, len(previous.prompt_text)):
            # A forced call's JSON, as the template writes it again (its own spacing and
            # escapes): the same call when it is the same JSON value.
            if not previous.forced:
                return None
            try:
                written, rest = json.JSONDecoder().raw_decode(prompt_text, len(previous.prompt_text))
                if written != json.loads(previous.generated_text, strict=False):
                    return None
            except (ValueError, RecursionError):
                return None
        stops = set(self.renderer.stop_token_ids)
        if generated[-1] in stops:
            generated = generated[:-1]  # the end of the turn: the template writes its own
        if any(token in stops for token in generated):
            return None
        return [*previous.prompt_ids, *generated, *self.renderer.encode(prompt_text[rest:])]

    def _drop_late_calls(self, turn: PendingTurn, generated: Generated, specs: list[ToolSpec]) -> None:
        """The last round (max_tool_rounds, or the tool time used up) is generated with
        toolChoice none; calls it writes anyway are not taken: the reply is the text before
        them, and says why."""
        parser = self.tool_support.parser
        assert parser is not None
        parsed = parser.parse(generated.text, specs)
        if parsed.calls or parsed.markup:
            generated.text = parsed.content.strip()
            generated.tool_parse_error = (
                "the model called tools again after the last round this request may run "
                f"(tools.max_tool_rounds = {self.tool_limits.max_tool_rounds}, or the request's tool time was used up)"
            )
            logger.info("Request {} of {}: calls after the last tool round dropped", log_ref(turn.key), turn.address)

    def _take_calls(
        self, turn: PendingTurn, plan: ToolPlan, generated: Generated, specs: list[ToolSpec], *, round_: int
    ) -> None:
        """Parse the answer's calls with the model's parser and check them (core/calls.py):
        valid calls end the generation with finishReason tool_calls; markup that is no valid
        call leaves the text as it is, with the reason."""
        parser = self.tool_support.parser
        assert parser is not None
        parsed = parser.parse(generated.text, specs)
        checked = check_calls(
            generated.text, parsed, specs, key=self.call_key(turn), round_=round_, validate_all=bool(plan.forced)
        )
        if checked.error is not None:
            # The reason quotes the model's call (its arguments, what the schema says of them):
            # the reply's toolParseError has it; the log at INFO says only that it happened.
            logger.info("Request {} of {}: tool call not taken (toolParseError)", log_ref(turn.key), turn.address)
            logger.debug("Request {} of {}: tool call not taken: {}", log_ref(turn.key), turn.address, checked.error)
            generated.tool_parse_error = checked.error
        elif checked.calls:
            generated.text, generated.tool_calls = checked.content.strip(), checked.calls
            generated.finish_reason = TOOL_CALLS

    async def _stream(
        self,
        turn: PendingTurn,
        request: GenerationRequest,
        budget: int = 0,
        *,
        stream: DeltaStream | None = None,
        hold: MarkupHold | None = None,
    ) -> Generated:
        """Run the generation, publishing deltas to ``stream``; what came out of it.

        Free text is split into reasoning and answer as it comes: the stream carries the answer,
        and the reasoning only with includeReasoning; ``hold`` keeps tool-call markup out of the
        answer's deltas. A generation still reasoning after
        ``budget`` completion tokens (the engine's count) is aborted: finishReason
        reasoning_budget, and what came after the budget is dropped."""
        generated = Generated(submitted=time.monotonic(), prompt_tokens=len(request.prompt_token_ids))
        splitter = None
        if request.sampling.structured is None:
            splitter = ReasoningSplitter(opened_in_prompt=self.renderer.opens_reasoning)
        reader = _Reader(stream, hold, splitter, turn.request.include_reasoning)
        over_budget = False
        turn.runtime.running[turn.key] = request.request_id
        try:
            async for update in self.engine.generate(request):
                if over_budget:
                    continue  # the abort takes effect within an engine step or two: dropped
                if budget and splitter is not None and splitter.state != "answer":
                    update = self._cut_at_budget(generated, splitter, update, budget)
                _count(generated, update)
                generated.token_ids.extend(update.token_ids)
                if update.delta:
                    reader.feed(update.delta)
                if splitter is not None and splitter.opened and self._over_budget(generated, splitter, update, budget):
                    over_budget = True
                    logger.info(
                        "Request {} of {}: reasoning budget of {} tokens reached",
                        log_ref(turn.key),
                        turn.address,
                        budget,
                    )
                    await self.engine.abort(request.request_id)
        except EngineDead as exc:
            logger.error(
                "Engine died: {}; stopping the worker (request {} is left for the restart)", exc, log_ref(turn.key)
            )
            self._engine_died(1)
            raise
        except StructuredOutputRejected as exc:
            logger.info("Engine refused the responseFormat of request {} of {}", log_ref(turn.key), turn.address)
            logger.debug("Engine's reason for refusing the responseFormat of {}: {}", turn.key, exc)
            message = f"the engine cannot use this schema: {str(exc)[:500]}"
            raise RequestError(ErrorCode.INVALID_SCHEMA, message) from None
        except ImagesRejected as exc:
            logger.info("Engine refused the images of request {} of {}", log_ref(turn.key), turn.address)
            raise RequestError(ErrorCode.INVALID_REQUEST, str(exc)[:500]) from None
        except EngineError as exc:
            logger.error("Engine error on request {} of {}: {}", log_ref(turn.key), turn.address, type(exc).__name__)
            logger.debug("Engine error on request {}: {}", turn.key, exc)
            raise RequestError(ErrorCode.ENGINE_ERROR, f"generation failed: {exc}") from None
        finally:
            turn.runtime.running.pop(turn.key, None)
        if over_budget:
            generated.finish_reason = REASONING_BUDGET
        generated.text = generated.raw_text = reader.finish()
        return generated

    def _cut_at_budget(
        self, generated: Generated, splitter: ReasoningSplitter, update: GenerationUpdate, budget: int
    ) -> GenerationUpdate:
        """The part of an update that is within the thinking budget, when the update crosses it
        still reasoning. vLLM hands a reader that lags behind (a busy event loop) several
        steps' tokens in one output: on a loaded 2-core machine 24 tokens came at once for a
        budget of 10. The budget is the user's, so the generation stops at it exactly; the
        update's own ids tell where (an engine that gives none is cut where its updates fall)."""
        before = update.completion_tokens - len(update.token_ids)
        if not update.token_ids or update.completion_tokens <= budget or before >= budget:
            return update
        kept = update.token_ids[: budget - before]
        # Decoded after a few of the tokens before, as the engine's incremental detokenizer
        # does: a word's leading space and a character split over tokens come out the same.
        context = generated.token_ids[-6:]
        head, whole = self.renderer.decode(context), self.renderer.decode([*context, *kept])
        text = (whole[len(head) :] if whole.startswith(head) else whole).rstrip("\ufffd")
        probe = copy.deepcopy(splitter)
        probe.feed(text)
        if not probe.reasoning:
            return update  # the think block closed within the budget: the update stands whole
        return dataclasses.replace(
            update, delta=text, token_ids=kept, completion_tokens=budget, finished=False, finish_reason=None
        )

    def _over_budget(
        self, generated: Generated, splitter: ReasoningSplitter, update: GenerationUpdate, budget: int
    ) -> bool:
        """Counts the reasoning tokens once the think block closes (or the generation ends in
        it); True when it is still open after ``budget`` tokens: the generation is aborted."""
        if generated.reasoning_tokens is None and not splitter.reasoning:  # the think block closed
            generated.reasoning_tokens = self._through_close(update)
        elif splitter.reasoning and (update.finished or (budget and update.completion_tokens >= budget)):
            generated.reasoning_tokens = update.completion_tokens
            return not update.finished
        return False

    def _through_close(self, update: GenerationUpdate) -> int:
        """The completion tokens up to the end of the think block, which closed within this
        update: at the close's own token where the update's ids show it (an update of several
        tokens: a reader behind the engine, or a reply read only at its end, where the update
        is the whole reply); else at the update's end."""
        ids = update.token_ids
        if len(ids) > 1:
            if self._think_close is None:
                encoded = self.renderer.encode(THINK_CLOSE)
                self._think_close = encoded[0] if len(encoded) == 1 else -1  # -1: no token of its own
            if self._think_close in ids:
                return update.completion_tokens - len(ids) + ids.index(self._think_close) + 1
        return update.completion_tokens

    def reply(self, turn: PendingTurn, generated: Generated) -> bytes:
        now = time.monotonic()
        received = turn.message.received_at
        engine = generated.engine_times
        latency = Latency(
            queue_ms=ms_between(received, generated.submitted),
            total_ms=ms_between(received, now),
            ttft_ms=ms_between(received, generated.first_token or now),
            engine_queue_ms=round(engine.queue_s * 1000, 1) if engine is not None else None,
            prefill_ms=round(engine.prefill_s * 1000, 1) if engine is not None else None,
        )
        usage = Usage(
            prompt_tokens=generated.prompt_tokens,
            completion_tokens=generated.completion_tokens,
            cached_tokens=generated.cached_tokens,
            image_tokens=generated.image_tokens or None,
            reasoning_tokens=generated.reasoning_tokens,
        )
        self.stats.record_reply(usage, latency, finish_reason=generated.finish_reason)
        logger.info(
            "Replied {} of {}: {} prompt ({} cached) + {} tokens, {}, {:.0f} ms",
            log_ref(turn.key),
            turn.address,
            usage.prompt_tokens,
            usage.cached_tokens,
            usage.completion_tokens,
            generated.finish_reason,
            latency.total_ms,
        )
        reply = ChatReply(
            session_id=turn.address.session,
            request_id=turn.key,
            reply=generated.text,
            reasoning=generated.reasoning,
            tool_calls=wire_calls(generated.tool_calls, generated.confirm_ids) or None,
            tool_parse_error=generated.tool_parse_error,
            worker_calls=generated.worker_calls or None,
            rounds=generated.rounds or None,
            finish_reason=generated.finish_reason,
            usage=usage,
            latency=latency,
        )
        return reply.to_json()


def _count(generated: Generated, update: GenerationUpdate) -> None:
    """The engine's counts so far, and the end."""
    if generated.first_token is None and update.completion_tokens > 0:
        generated.first_token = update.first_token_at or time.monotonic()
    if update.engine_times is not None:
        generated.engine_times = update.engine_times
    generated.completion_tokens = update.completion_tokens
    generated.prompt_tokens, generated.cached_tokens = update.prompt_tokens, update.cached_tokens
    generated.image_tokens = update.image_tokens
    if update.finished:
        generated.finish_reason = update.finish_reason or "stop"

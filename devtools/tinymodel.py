"""Generate a tiny, randomly initialised ChatML chat model that vLLM can load.

Why this exists: the worker's tests, the demo and the benchmarks must run on
machines with no access to the Hugging Face hub, so none of them may download
a model.  Instead they call :func:`generate_tiny_model`, which builds a model
directory from scratch in a few seconds, deterministically (fixed seeds, a
built-in training text), so two runs produce byte-identical tokenizer files
and identical weights.

What it writes into ``outdir``:

* ``tokenizer.json`` / ``tokenizer_config.json``: a byte-level BPE tokenizer
  trained with the ``tokenizers`` library on generated English-like text.  Its
  normaliser and pre-tokeniser are exactly those of ``Qwen2Tokenizer`` (NFC,
  the Qwen split regex, ByteLevel without regex), because transformers 5
  rebuilds any qwen2 model's tokenizer as ``Qwen2Tokenizer`` from the vocab and
  merges; with the same pipeline both loading paths encode identically.
  Special tokens: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>``
  (eos).  ``<think>`` and ``</think>`` are *added, non-special* tokens (as in
  Qwen3/QwQ), so ``skip_special_tokens=True`` still keeps them in the
  detokenised text and the reasoning block can be parsed from it.
  The ChatML ``chat_template`` renders system/user/assistant turns;
  ``add_generation_prompt`` emits ``<|im_start|>assistant\\n`` and, when
  ``think=True``, also opens ``<think>\\n`` (like QwQ).
* ``config.json`` / ``model.safetensors``: a ``Qwen2ForCausalLM`` with
  head_dim 64 (hidden 128, 2 query heads, 1 KV head, 2 layers, intermediate
  256), max_position_embeddings 4096, stored in bfloat16 (what vLLM's CPU
  backend runs natively; no dtype conversion at load).
* ``generation_config.json`` with ``eos_token_id`` = the ``<|im_end|>`` id.

:func:`generate_geometry_model` instead writes a model directory with the real
geometry of a Qwen2.5/QwQ model (see ``GEOMETRIES``) but *no weights*, for GPU
benchmarks run with vLLM's ``load_format="dummy"``: ``config.json``,
``generation_config.json`` and the same kind of tokenizer (same special tokens
and chat template), whose vocab is the trained one extended with synthetic
letter n-grams (and their merges) to exactly the geometry's ``vocab_size``, so
every id a dummy-weight model can sample decodes.

Usage: ``python -m devtools.tinymodel OUTDIR [--vocab-size N] [--think]``
or ``python -m devtools.tinymodel OUTDIR --geometry {qwen2.5-0.5b,qwen3-1.7b,qwen2.5-7b,qwq-32b} [--think]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from worker.prepare_model import QWEN25_TOOL_RESULT, tools_chat_template

DEFAULT_VOCAB_SIZE = 3072
SEED = 1234

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Qwen2.5's tool markup is made of added, non-special tokens (so skip_special_tokens keeps
# them in the text, where vLLM's hermes parser finds them): the same here.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
ADDED_TOKENS = (THINK_OPEN, THINK_CLOSE, *TOOL_TOKENS)

# Qwen2.5-Instruct's chat template (tokenizer_config.json of Qwen/Qwen2.5-*-Instruct), as
# published: tools in the system message, calls as <tool_call> JSON, results grouped in a
# user message of <tool_response> blocks. The one copy is worker/prepare_model.py's
# tools_chat_template (the demo model's is the same but for how it writes tool results).
# QWEN_DEFAULT_SYSTEM is what it says when a conversation has no system message; the tiny
# model's template leaves that line out (a test prompt is then exactly its messages), which is
# the only difference.
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def qwen25_chat_template(*, default_system: str | None = QWEN_DEFAULT_SYSTEM, think: bool = False) -> str:
    """Qwen2.5-Instruct's tools chat template; ``default_system`` None leaves out the system
    message it adds to a conversation that has none; ``think`` opens <think> (like QwQ)."""
    return tools_chat_template(default_system, tool_result=QWEN25_TOOL_RESULT, think=think)


# Same regex as transformers' Qwen2Tokenizer (PRETOKENIZE_REGEX).
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_WORDS = (
    "the a an and or but if when while because so then than of to in on at by for with from "
    "into over under about after before between through during i you he she it we they me him "
    "her us them my your his its our their this that these those is are was were be been being "
    "have has had do does did will would can could should may might must shall not no yes all "
    "some any each every many much more most few less other another such only own same time "
    "year day week hour minute people man woman child world life hand part place case point "
    "group number fact water room mother father house friend question answer problem system "
    "program model message server client worker request reply token stream queue cache prefix "
    "engine test bench demo chat say make go know take see come think look want give use find "
    "tell ask work seem feel try leave call keep start run write read send receive open close "
    "good new first last long great little old big high small large next early young important "
    "public bad able right left late hard easy fast slow quiet red blue green black white cold "
    "warm bright dark simple clear short"
).split()
_PUNCT = (".", ".", ".", "?", "!", ",", ";", ":")


_ONSETS = (
    *("b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w"),
    *("br", "ch", "cl", "dr", "fr", "gr", "pl", "pr", "sh", "st", "th", "tr", ""),
)
_VOWELS = ("a", "e", "i", "o", "u", "ea", "ai", "ou", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "ght")


def _training_text(n_sentences: int = 6000) -> list[str]:
    """Deterministic English-like sentences: common English words mixed with
    pronounceable pseudo-words (so BPE has enough variety to fill the vocab),
    plus some numbers and quotes."""
    rng = random.Random(SEED)
    lexicon = list(_WORDS)
    for _ in range(6000):
        syllables = rng.randint(1, 3)
        lexicon.append(
            "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
        )
    lines: list[str] = []
    for i in range(n_sentences):
        words = [rng.choice(_WORDS) if rng.random() < 0.6 else rng.choice(lexicon) for _ in range(rng.randint(4, 16))]
        words[0] = words[0].capitalize()
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 10000)))
        if rng.random() < 0.1:
            words.insert(rng.randrange(len(words)), f'"{rng.choice(_WORDS)}"')
        sep = "\n" if i % 7 == 0 else " "
        lines.append(" ".join(words) + rng.choice(_PUNCT) + sep)
    return lines


def chat_template(think: bool = False) -> str:
    """ChatML with Qwen2.5's tool calling (qwen25_chat_template without its default system
    message: a conversation without tools renders as plain ChatML); with ``think`` the
    generation prompt opens ``<think>``."""
    return qwen25_chat_template(default_system=None, think=think)


def _build_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    tok.add_tokens(list(ADDED_TOKENS))  # non-special added tokens
    return tok


def _tokenizer_config(tok: Any, think: bool) -> dict[str, Any]:
    decoder: dict[str, dict[str, Any]] = {}
    for content in (*SPECIAL_TOKENS, *ADDED_TOKENS):
        decoder[str(tok.token_to_id(content))] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": content in SPECIAL_TOKENS,
        }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 4096,
        "split_special_tokens": False,
        "chat_template": chat_template(think),
    }


def _write_model(outdir: Path, vocab_size: int, eos_id: int, pad_id: int, rare_special_ids: tuple[int, ...]) -> None:
    import torch
    import transformers

    # transformers is only partly typed (and its config kwargs differ between
    # 4.x and 5.x), so it is used through Any; rope_theta is accepted by both.
    tf: Any = transformers
    tf.utils.logging.disable_progress_bar()
    config = tf.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_sliding_window=False,
    )
    torch.manual_seed(SEED)
    model = tf.Qwen2ForCausalLM(config)
    if rare_special_ids:
        # Near-uniform random logits would end a reply with probability 2/vocab per token,
        # so long generations (cancel, batching tests) would end early at random. Spread
        # the logits (std ~3) and give the end-of-turn tokens logit 0: they become ~1e-6
        # likely and replies run to maxTokens.
        with torch.no_grad():
            embeddings = model.get_input_embeddings().weight
            embeddings.mul_(3.0 / (embeddings.std() * config.hidden_size**0.5))
            embeddings[list(rare_special_ids)] = 0.0
    model = model.bfloat16()
    model.save_pretrained(outdir, safe_serialization=True)
    tf.GenerationConfig(bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False).save_pretrained(
        outdir
    )


def generate_tiny_model(
    outdir: Path,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    think: bool = False,
    rare_end_of_turn: bool = True,
) -> Path:
    """Write the tiny chat model into ``outdir`` (created if missing); return it.

    With ``rare_end_of_turn`` (the default) the special tokens (and, with ``think``,
    ``</think>``) are almost never sampled, so every reply runs to its maxTokens and a thinking
    model's reasoning to its budget; without it a reply ends by itself about once in
    vocab_size/2 tokens."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer(vocab_size)
    tok.save(str(outdir / "tokenizer.json"))
    (outdir / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(tok, think), indent=2) + "\n", encoding="utf-8"
    )
    eos_id = int(tok.token_to_id(IM_END))
    pad_id = int(tok.token_to_id(ENDOFTEXT))
    rare_ids = tuple(int(tok.token_to_id(t)) for t in SPECIAL_TOKENS)
    if think:  # a thinking model that never closes its think block: the budget always ends it
        rare_ids += (int(tok.token_to_id(THINK_CLOSE)),)
    _write_model(outdir, int(tok.get_vocab_size()), eos_id, pad_id, rare_ids if rare_end_of_turn else ())
    return outdir


# name: (hidden, layers, attention heads, KV heads, intermediate, vocab, tied embeddings)
GEOMETRIES: dict[str, tuple[int, int, int, int, int, int, bool]] = {
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936, True),
    # Qwen3-1.7B's sizes (1.72 B parameters; issue 31's "2B geometry of 28 layers, hidden 2048"),
    # run as the Qwen2 architecture (no QK norm: the same shapes and cost to within a few %).
    "qwen3-1.7b": (2048, 28, 16, 8, 6144, 151936, True),
    "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064, False),
    "qwq-32b": (5120, 64, 40, 8, 27648, 152064, False),
}


def _synthetic_tokens() -> Iterator[tuple[str, str, str]]:
    """Yield ``(token, left, right)``: lowercase letter n-grams, bare and with the
    ByteLevel space ``Ġ``, shortest first, so ``left`` (the token minus its last
    letter) always comes earlier (or is a byte symbol)."""
    for n in itertools.count(1):
        for prefix in ("", "\u0120"):
            if n == 1 and not prefix:
                continue  # single letters are byte symbols already
            for letters in itertools.product(string.ascii_lowercase, repeat=n):
                token = prefix + "".join(letters)
                yield token, token[:-1], token[-1]


def _build_geometry_tokenizer(vocab_size: int) -> Any:
    """The tiny model's trained tokenizer, its BPE vocab extended with synthetic
    n-grams and merges to ``vocab_size`` ids in all (added tokens last)."""
    from tokenizers import Tokenizer

    data = json.loads(_build_tokenizer(DEFAULT_VOCAB_SIZE).to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list[list[str]] = data["model"]["merges"]
    n_added = sum(1 for t in data["added_tokens"] if t["content"] in ADDED_TOKENS)
    target = vocab_size - n_added
    if target < len(vocab):
        raise ValueError(f"vocab_size {vocab_size} is below the trained tokenizer's {len(vocab) + n_added}")
    synthetic = _synthetic_tokens()
    while len(vocab) < target:
        token, left, right = next(synthetic)
        if token not in vocab:
            vocab[token] = len(vocab)
            merges.append([left, right])
    for i, added in enumerate(t for t in data["added_tokens"] if t["content"] in ADDED_TOKENS):
        added["id"] = target + i
    return Tokenizer.from_str(json.dumps(data))


def generate_geometry_model(outdir: Path, geometry: str, *, think: bool = False) -> Path:
    """Write a weightless model directory with a real geometry (a ``GEOMETRIES`` key)
    into ``outdir`` (created if missing); return it. Load it with ``load_format="dummy"``."""
    hidden, layers, heads, kv_heads, intermediate, vocab_size, tied = GEOMETRIES[geometry]
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    tok = _build_geometry_tokenizer(vocab_size)
    if tok.get_vocab_size() != vocab_size:
        raise AssertionError(f"tokenizer has {tok.get_vocab_size()} ids, wanted {vocab_size}")
    tok.save(str(outdir / "tokenizer.json"))
    tok_config = _tokenizer_config(tok, think) | {"model_max_length": 32768}
    (outdir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")
    eos_id = int(tok.token_to_id(IM_END))
    pad_id = int(tok.token_to_id(ENDOFTEXT))
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "max_position_embeddings": 32768,
        "max_window_layers": layers,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
        # as in the real Qwen2.5 configs; without it transformers 5 suspects a Mistral tokenizer and warns
        "transformers_version": "4.43.1",
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    generation = {"bos_token_id": None, "do_sample": False, "eos_token_id": eos_id, "pad_token_id": pad_id}
    for name, content in (("config.json", config), ("generation_config.json", generation)):
        (outdir / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    return outdir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--vocab-size", type=int, default=None, help=f"default {DEFAULT_VOCAB_SIZE}")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), help="real geometry, no weights (load_format=dummy)")
    parser.add_argument("--think", action="store_true", help="generation prompt opens <think>")
    parser.add_argument(
        "--natural-stops", action="store_true", help="let replies end by themselves (1 in vocab/2 tokens)"
    )
    args = parser.parse_args(argv)
    if args.geometry is not None:
        if args.vocab_size is not None or args.natural_stops:
            parser.error("--geometry fixes the vocab and has no weights: drop --vocab-size / --natural-stops")
        print(generate_geometry_model(args.outdir, args.geometry, think=args.think))
        return
    path = generate_tiny_model(
        args.outdir,
        vocab_size=DEFAULT_VOCAB_SIZE if args.vocab_size is None else args.vocab_size,
        think=args.think,
        rare_end_of_turn=not args.natural_stops,
    )
    print(path)


if __name__ == "__main__":
    main()

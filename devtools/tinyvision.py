"""Generate a tiny, randomly initialised Qwen2-VL or Qwen3-VL vision chat model that vLLM can load.

Why this exists: the worker's vision tests run on machines with no access to the Hugging Face
hub, and must run the model family users run (Qwen2-VL / Qwen3-VL: the same placeholders,
processor and multimodal rotary positions). :func:`generate_tiny_vision_model` builds one
from scratch in seconds, deterministically, from the tiny text model's pieces
(devtools/tinymodel.py: its trained tokenizer, its ChatML tools template):

* the tokenizer gains Qwen-VL's four vision special tokens, ``<|vision_start|>``,
  ``<|vision_end|>``, ``<|image_pad|>`` and ``<|video_pad|>``;
* the chat template renders a message's content given as a list of parts, as Qwen2-VL's and
  Qwen3-VL's templates do: an image part (``{"type": "image"}``) becomes
  ``<|vision_start|><|image_pad|><|vision_end|>``, which vLLM expands to the image's tokens;
* ``config.json`` / ``model.safetensors``: a ``Qwen2VLForConditionalGeneration``: a text part
  of hidden 128, 2 layers, 2 query heads and 1 KV head of head_dim 64, with ``mrope_section``
  [8, 12, 12] (summing to head_dim / 2, as vLLM's multimodal rotary needs); a one-layer vision
  tower of width 64 whose merger projects to the text's hidden size 128 (Qwen2-VL's
  ``vision_config.hidden_size`` is the text's); bfloat16, as the CPU backend runs natively;
* ``preprocessor_config.json`` and ``video_preprocessor_config.json``: Qwen2-VL's image and
  video processors with the published model's settings (14-pixel patches merged 2x2: one
  token per 28x28 pixels; between 56x56 and 28x28x1280 pixels an image).

With ``family="qwen3-vl"``: a ``Qwen3VLForConditionalGeneration`` instead (what Qwen3-VL-2B
users run): the same text part with interleaved multimodal rotary positions and a head_dim of
its own, a one-layer vision tower of width 64 whose ``out_hidden_size`` is the text's hidden
size, ``num_position_embeddings`` 64 (a perfect square: vLLM interpolates the learned position
grid), deepstack from its one layer, and Qwen3-VL's processor settings (16-pixel patches: one
token per 32x32 pixels).

The CPU attention backend needs a block size that is a multiple of 32 (the engine's
``block_size``, as for the text model).

With ``geometry="qwen3-vl-2b"`` (:func:`generate_vision_geometry_model`): Qwen3-VL-2B-Instruct's
published sizes and *no weights*, for GPU benchmarks with ``load_format="dummy"``: the text part
of hidden 2048, 28 layers, 16 query and 8 KV heads of head_dim 128, intermediate 6144, vocab
151936 (tied), interleaved multimodal rotary sections [24, 20, 20]; a vision tower of depth 24,
width 1024, 16 heads, intermediate 4096, 16-pixel patches merged 2x2 to the text's 2048,
2304 learned positions (48x48) and deepstack from layers 5, 11 and 17; the real processor
settings (as above) and a byte-level BPE tokenizer of exactly the vocab (devtools/tinymodel.py
geometry tokenizer) with the four vision tokens.

Usage: ``python -m devtools.tinyvision OUTDIR [--family {qwen2-vl,qwen3-vl}] [--natural-stops]``
or ``python -m devtools.tinyvision OUTDIR --geometry qwen3-vl-2b``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from devtools.tinymodel import (
    DEFAULT_VOCAB_SIZE,
    ENDOFTEXT,
    IM_END,
    SEED,
    SPECIAL_TOKENS,
    _build_geometry_tokenizer,
    _build_tokenizer,
    _tokenizer_config,
    chat_template,
)

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
# What one image part renders as: vLLM expands the <|image_pad|> to the image's tokens.
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END

HIDDEN = 128
HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # Qwen2-VL's text part has no head_dim of its own
MROPE_SECTION = [8, 12, 12]  # temporal, height, width: sums to HEAD_DIM / 2
VISION_WIDTH = 64
PATCH = 14
MERGE = 2
# Qwen2-VL-Instruct's published preprocessor settings (min_pixels, max_pixels).
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]

# The content of a message, rendered: a string as it is, a list of parts as Qwen-VL's
# templates render it (text parts' text, each image part a placeholder; "image" and
# "image_url" parts both count, as in Qwen3-VL's template).
_RENDER_CONTENT = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part.type == 'image' or part.type == 'image_url' or 'image' in part -%}"
    f"{{{{- '{IMAGE_PLACEHOLDER}' -}}}}"
    "{%- elif part.type == 'text' -%}{{- part.text -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}\n"
)


# The engine-tier tests' bound: an image is a few dozen tokens (one per 28x28 pixels after scaling).
TEST_MAX_PIXELS = 28 * 28 * 64


def tiny_engine_settings(model: Path, image_threads: int | None = None) -> tuple[Any, Any]:
    """The engine configuration and image settings the engine-tier tests start the tiny vision
    model with: CPU-sized (256 MiB of KV cache, 4 sequences), eager, the tests' block size; a
    small processor cache and one image thread, or ``image_threads`` and no cache."""
    from devtools.worker_process import BLOCK_SIZE
    from worker.config.models import EngineConfig
    from worker.engine.port import VisionSettings

    config = EngineConfig(
        model=str(model),
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        max_num_seqs=4,
        extra={"kv_cache_memory_bytes": 256 * 1024 * 1024},
    )
    cache = 0.25 if image_threads is None or image_threads == 1 else None
    vision = VisionSettings(
        max_pixels=TEST_MAX_PIXELS, max_images_in_prompt=2, processor_cache_gib=cache, image_threads=image_threads
    )
    return config, vision


def vision_chat_template(think: bool = False) -> str:
    """The tiny model's ChatML tools template (devtools/tinymodel.py chat_template) with every
    message's content rendered by ``render_content``: strings as before, lists of parts with
    their images' placeholders."""
    template = chat_template(think)
    for old in ("messages[0]['content']", "message.content"):
        template = template.replace(old, f"render_content({old})")
    return _RENDER_CONTENT + template


FAMILIES = ("qwen2-vl", "qwen3-vl")
# Qwen3-VL-2B-Instruct's published preprocessor settings.
QWEN3_PATCH = 16
QWEN3_MIN_PIXELS = 65536
QWEN3_MAX_PIXELS = 16777216


def _processor_configs(family: str) -> dict[str, dict[str, Any]]:
    qwen3 = family == "qwen3-vl"
    common = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5] if qwen3 else IMAGE_MEAN,
        "image_std": [0.5, 0.5, 0.5] if qwen3 else IMAGE_STD,
        "rescale_factor": 1 / 255,
        "patch_size": QWEN3_PATCH if qwen3 else PATCH,
        "temporal_patch_size": 2,
        "merge_size": MERGE,
        "size": {
            "shortest_edge": QWEN3_MIN_PIXELS if qwen3 else MIN_PIXELS,
            "longest_edge": QWEN3_MAX_PIXELS if qwen3 else MAX_PIXELS,
        },
        "processor_class": "Qwen3VLProcessor" if qwen3 else "Qwen2VLProcessor",
    }
    video = "Qwen3VLVideoProcessor" if qwen3 else "Qwen2VLVideoProcessor"
    return {
        "preprocessor_config.json": {"image_processor_type": "Qwen2VLImageProcessor", **common},
        "video_preprocessor_config.json": {"video_processor_type": video, **common},
    }


def _qwen3_config(tf: Any, vocab_size: int, ids: dict[str, int]) -> Any:
    return tf.Qwen3VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": HIDDEN,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": HEADS,
            "num_key_value_heads": 1,
            "head_dim": HEAD_DIM,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": MROPE_SECTION,
                "mrope_interleaved": True,
            },
            "bos_token_id": None,
            "eos_token_id": ids[IM_END],
            "pad_token_id": ids[ENDOFTEXT],
            "tie_word_embeddings": True,
        },
        vision_config={
            "depth": 1,
            "hidden_size": VISION_WIDTH,
            "intermediate_size": 2 * VISION_WIDTH,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": QWEN3_PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": 2,
            "out_hidden_size": HIDDEN,  # the merger's output: the text's hidden size
            "num_position_embeddings": 64,  # a perfect square (an 8x8 grid, interpolated)
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )


def _write_model(
    outdir: Path, vocab_size: int, ids: dict[str, int], rare_ids: tuple[int, ...], family: str = "qwen2-vl"
) -> None:
    import torch
    import transformers

    tf: Any = transformers
    tf.utils.logging.disable_progress_bar()
    config = _qwen3_config(tf, vocab_size, ids) if family == "qwen3-vl" else _qwen2_config(tf, vocab_size, ids)
    torch.manual_seed(SEED)
    model_class = tf.Qwen3VLForConditionalGeneration if family == "qwen3-vl" else tf.Qwen2VLForConditionalGeneration
    model = model_class(config)
    if rare_ids:
        # As the text model (devtools/tinymodel.py): logits spread, the end-of-turn tokens at
        # logit 0, so that a reply runs to its maxTokens.
        with torch.no_grad():
            embeddings = model.get_input_embeddings().weight
            embeddings.mul_(3.0 / (embeddings.std() * HIDDEN**0.5))
            embeddings[list(rare_ids)] = 0.0
    model = model.bfloat16()
    model.save_pretrained(outdir, safe_serialization=True)
    tf.GenerationConfig(
        bos_token_id=None, eos_token_id=ids[IM_END], pad_token_id=ids[ENDOFTEXT], do_sample=False
    ).save_pretrained(outdir)


def _qwen2_config(tf: Any, vocab_size: int, ids: dict[str, int]) -> Any:
    return tf.Qwen2VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": HIDDEN,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": HEADS,
            "num_key_value_heads": 1,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": MROPE_SECTION},
            "bos_token_id": None,
            "eos_token_id": ids[IM_END],
            "pad_token_id": ids[ENDOFTEXT],
            "use_sliding_window": False,
            "tie_word_embeddings": True,
        },
        vision_config={
            "depth": 1,
            "embed_dim": VISION_WIDTH,
            "hidden_size": HIDDEN,  # the merger's output: the text's hidden size
            "num_heads": 2,
            "mlp_ratio": 2,
            "in_channels": 3,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": 2,
        },
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )


def generate_tiny_vision_model(
    outdir: Path, *, family: str = "qwen2-vl", rare_end_of_turn: bool = True, think: bool = False
) -> Path:
    """Write the tiny vision chat model of ``family`` (FAMILIES) into ``outdir`` (created if
    missing); return it. ``rare_end_of_turn`` as for generate_tiny_model: replies run to their
    maxTokens."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: one of {', '.join(FAMILIES)}")
    from tokenizers import AddedToken

    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer(DEFAULT_VOCAB_SIZE)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    _write_tokenizer_and_processor(outdir, tok, family, think)
    ids = {t: int(tok.token_to_id(t)) for t in (*SPECIAL_TOKENS, *VISION_TOKENS)}
    rare = tuple(ids[t] for t in SPECIAL_TOKENS) if rare_end_of_turn else ()
    _write_model(outdir, int(tok.get_vocab_size()), ids, rare, family)
    return outdir


def _write_tokenizer_and_processor(outdir: Path, tok: Any, family: str, think: bool, max_length: int = 4096) -> None:
    """tokenizer.json, tokenizer_config.json (the vision chat template), chat_template.jinja
    and the processor configs of ``family``."""
    tok.save(str(outdir / "tokenizer.json"))
    tok_config = _tokenizer_config(tok, think) | {"model_max_length": max_length}
    for token in VISION_TOKENS:
        tok_config["added_tokens_decoder"][str(tok.token_to_id(token))] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    template = vision_chat_template(think)
    tok_config["chat_template"] = template
    (outdir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")
    # The processor's own copy (AutoProcessor's apply_chat_template reads this file).
    (outdir / "chat_template.jinja").write_text(template, encoding="utf-8")
    for name, content in _processor_configs(family).items():
        (outdir / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")


# Qwen3-VL-2B-Instruct's published config.json (text_config, vision_config): what a benchmark
# of the model users run needs, the weights being vLLM's dummy ones.
GEOMETRIES: dict[str, dict[str, dict[str, Any]]] = {
    "qwen3-vl-2b": {
        "text": {
            "hidden_size": 2048,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "intermediate_size": 6144,
            "vocab_size": 151936,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": True,
        },
        "vision": {
            "depth": 24,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_heads": 16,
            "hidden_act": "gelu_pytorch_tanh",
            "in_channels": 3,
            "patch_size": QWEN3_PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": 2,
            "out_hidden_size": 2048,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [5, 11, 17],
        },
    },
}


def generate_vision_geometry_model(outdir: Path, geometry: str, *, think: bool = False) -> Path:
    """Write a weightless Qwen3-VL model directory of a real geometry (a ``GEOMETRIES`` key)
    into ``outdir`` (created if missing); return it. Load it with ``load_format="dummy"``."""
    if geometry not in GEOMETRIES:
        raise ValueError(f"geometry {geometry!r}: one of {', '.join(GEOMETRIES)}")
    import transformers
    from tokenizers import AddedToken

    sizes = GEOMETRIES[geometry]
    vocab_size = int(sizes["text"]["vocab_size"])
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    # The geometry tokenizer fills the vocab but for the four vision tokens, added last.
    tok = _build_geometry_tokenizer(vocab_size - len(VISION_TOKENS))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    if tok.get_vocab_size() != vocab_size:
        raise AssertionError(f"tokenizer has {tok.get_vocab_size()} ids, wanted {vocab_size}")
    _write_tokenizer_and_processor(outdir, tok, "qwen3-vl", think, max_length=32768)
    ids = {t: int(tok.token_to_id(t)) for t in (*SPECIAL_TOKENS, *VISION_TOKENS)}
    tf: Any = transformers
    config = tf.Qwen3VLConfig(
        text_config={
            **sizes["text"],
            "bos_token_id": None,
            "eos_token_id": ids[IM_END],
            "pad_token_id": ids[ENDOFTEXT],
            "dtype": "bfloat16",
        },
        vision_config=sizes["vision"],
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )
    data = config.to_dict()
    # vLLM reads the architecture and the weights' dtype from config.json (no weights here).
    data |= {"architectures": ["Qwen3VLForConditionalGeneration"], "dtype": "bfloat16", "torch_dtype": "bfloat16"}
    (outdir / "config.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    generation = {"bos_token_id": None, "do_sample": False, "eos_token_id": ids[IM_END], "pad_token_id": ids[ENDOFTEXT]}
    (outdir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    return outdir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--family", choices=FAMILIES, default="qwen2-vl")
    parser.add_argument("--think", action="store_true", help="generation prompt opens <think>")
    parser.add_argument(
        "--natural-stops", action="store_true", help="let replies end by themselves (1 in vocab/2 tokens)"
    )
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), help="real geometry, no weights (load_format=dummy)")
    args = parser.parse_args(argv)
    if args.geometry is not None:
        print(generate_vision_geometry_model(args.outdir, args.geometry, think=args.think))
        return
    print(
        generate_tiny_vision_model(
            args.outdir, family=args.family, rare_end_of_turn=not args.natural_stops, think=args.think
        )
    )


if __name__ == "__main__":
    main()

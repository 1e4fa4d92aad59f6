"""The vision phase's arithmetic and inputs (bench/vision.py): images/s, the second turn's
prefix-cache hit and its cover of the first prompt, the lag summary, the generated JPEGs, the
report; and the qwen3-vl-2b geometry it runs on (devtools/tinyvision.py). No engine."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from bench.vision import (
    HEIGHT,
    WIDTH,
    TurnOutcome,
    first_turn_covered,
    lag_summary,
    make_jpeg,
    turn_summary,
    vision_markdown,
)


def _turn(prompt: int, cached: int, images: int, wall_s: float = 2.0) -> dict:
    outcomes = [TurnOutcome(i, 0.1 * (i + 1), 1.0, prompt, cached + i, 768, 32) for i in range(4)]
    summary = turn_summary(outcomes, wall_s, images)
    summary["outcomes"] = [
        [o.session, o.ttft_s, o.total_s, o.prompt_tokens, o.cached_tokens, 768, 32] for o in outcomes
    ]
    return summary


def test_a_turn_summary_counts_images_per_second_and_the_cache_hit() -> None:
    first = _turn(798, 0, images=4)
    assert first["images_per_s"] == 2.0 and first["tok_per_s"] == 64.0
    assert first["cache_hit"] == pytest.approx(6 / (4 * 798), abs=1e-3)  # 0 + 1 + 2 + 3 cached
    assert first["image_tokens_mean"] == 768.0
    second = _turn(873, 784, images=0)
    assert second["images_per_s"] is None  # a text turn: no images to count
    assert second["cache_hit"] == pytest.approx((4 * 784 + 6) / (4 * 873), abs=1e-3)
    assert second["cache_hit_min"] == round(784 / 873, 3)


def test_the_second_turn_covers_the_first_prompt() -> None:
    """Cached tokens of the second turn over the first turn's prompt, capped at 1."""
    covered = first_turn_covered(_turn(798, 0, images=4), _turn(873, 784, images=0))
    assert covered["first_turn_covered_min"] == round(784 / 798, 3)
    assert first_turn_covered(_turn(100, 0, 4), _turn(873, 784, 0))["first_turn_covered"] == 1.0


def test_lag_percentiles() -> None:
    lag = lag_summary([1.0] * 98 + [50.0, 300.0])
    assert lag["samples"] == 100 and lag["p50_ms"] == 1.0 and lag["max_ms"] == 300.0 and lag["p99_ms"] == 50.0
    assert lag_summary([]) == {"samples": 0}


def test_the_generated_jpegs_differ_by_seed_and_have_the_size_asked() -> None:
    from PIL import Image

    one, again, other = make_jpeg(1), make_jpeg(1), make_jpeg(2)
    assert one == again and one != other
    with Image.open(io.BytesIO(one)) as image:
        assert image.format == "JPEG" and image.size == (WIDTH, HEIGHT)
    assert 50_000 < len(one) < 400_000  # a camera snapshot's size, far below the request limit


def test_the_report_puts_worker_and_raw_side_by_side() -> None:
    run = {"first": _turn(798, 0, images=4), "second": _turn(873, 784, images=0)}
    lag = {"idle": lag_summary([1.0, 2.0]), "4": {"first": lag_summary([3.0]), "second": lag_summary([4.0])}}
    result = {
        "image": {"jpeg_bytes_mean": 115_000},
        "max_tokens": 32,
        "sessions": [4],
        "runs": {"worker": {"4": run}, "raw": {"4": run}},
        "lag": {"worker": lag, "raw": lag},
        "worker_over_raw_images_per_s": {"4": 1.0},
    }
    text = vision_markdown(json.loads(json.dumps(result)))
    assert "| 4 | worker | 2.0 |" in text and "| 4 | raw | 2.0 |" in text
    assert "| worker | 4 sessions, 1st turn | 3.0 ms |" in text


def test_the_qwen3_vl_2b_geometry_has_the_published_sizes(tmp_path: Path) -> None:
    """config.json as transformers reads it, the tokenizer's vocab exactly the model's, the
    vision tokens the config names, an image part rendered as one placeholder."""
    import transformers

    from devtools.tinyvision import IMAGE_PLACEHOLDER, generate_vision_geometry_model

    model = generate_vision_geometry_model(tmp_path / "m", "qwen3-vl-2b")
    config = transformers.AutoConfig.from_pretrained(model)
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (
        2048,
        28,
        16,
        8,
    )
    assert (text.head_dim, text.intermediate_size, text.vocab_size) == (128, 6144, 151936)
    assert text.rope_parameters["mrope_section"] == [24, 20, 20] and text.rope_parameters["mrope_interleaved"]
    assert (vision.depth, vision.hidden_size, vision.out_hidden_size, vision.patch_size) == (24, 1024, 2048, 16)
    assert vision.num_position_embeddings == 2304 and vision.deepstack_visual_indexes == [5, 11, 17]
    assert json.loads((model / "config.json").read_text())["architectures"] == ["Qwen3VLForConditionalGeneration"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    assert len(tokenizer) == 151936
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == config.image_token_id
    message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    assert IMAGE_PLACEHOLDER + "hi" in tokenizer.apply_chat_template(message, tokenize=False)
    with pytest.raises(ValueError, match="qwen3-vl-2b"):
        generate_vision_geometry_model(tmp_path / "x", "qwen3-vl-99b")

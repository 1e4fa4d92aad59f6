"""Sampling defaults come from the model: a configuration that sets no sampling value takes the
model's generation_config.json values, else the built-in ones (worker/config/models.py
``resolve_sampling``, resolved once at start by worker/server.py), and the prepared demo model
carries its card's recommendation (worker/prepare_model.py). The run through a worker:
tests/engine/test_model_defaults.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker import prepare_model as models
from worker.config.loader import example_config, load_config, reference_markdown, render_toml
from worker.config.models import GenerationConfig, WorkerConfig, read_model_defaults, resolve_sampling


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):  # what the start checks for
        (model / name).write_text("{}")
    return model


def with_generation_config(model: Path, values: dict[str, object]) -> Path:
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **values}))
    return model


def resolved(argv: list[str], model: Path, environ: dict[str, str] | None = None) -> dict[str, tuple[object, str]]:
    config, _ = load_config([*argv, "--model", str(model)], environ=environ or {})
    values, problem = read_model_defaults(config.engine.model)
    assert problem is None
    generation, sources = resolve_sampling(config.generation, values)
    assert {s.name: s.value for s in sources} == {s.name: getattr(generation, s.name) for s in sources}
    return {s.name: (s.value, s.source) for s in sources}


def test_unset_defaults_are_the_models_and_else_the_built_in_ones(model_dir: Path) -> None:
    with_generation_config(model_dir, {"temperature": 0.6, "top_p": 0.8, "top_k": 20, "do_sample": True})
    assert resolved([], model_dir) == {
        "temperature": (0.6, "model"),
        "top_p": (0.8, "model"),
        "top_k": (20, "model"),
        "min_p": (0.0, "built-in"),
        "repetition_penalty": (1.0, "built-in"),
    }


def test_a_value_the_configuration_gives_wins_even_at_the_built_in_default(model_dir: Path, tmp_path: Path) -> None:
    """Set by a flag, the environment or the TOML file, even to the value it has by default."""
    with_generation_config(model_dir, {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.05})
    toml = tmp_path / "worker.toml"
    toml.write_text("[generation]\ntop_p = 0.95\n")
    got = resolved(["--temperature", "0.7", "--config", str(toml)], model_dir, {"WORKER_TOP_K": "0"})
    assert got["temperature"] == (0.7, "config")
    assert got["top_p"] == (0.95, "config")
    assert got["top_k"] == (0, "config")
    assert got["repetition_penalty"] == (1.05, "model")


def test_a_model_without_sampling_values_gets_the_built_in_defaults(model_dir: Path) -> None:
    """No generation_config.json, or one without sampling (transformers' do_sample is not read,
    as vLLM does not read it)."""
    builtin = {name: (getattr(GenerationConfig(), name), "built-in") for name in resolved([], model_dir)}
    assert resolved([], model_dir) == builtin
    assert builtin["temperature"] == (0.7, "built-in") and builtin["top_p"] == (0.95, "built-in")
    with_generation_config(model_dir, {"do_sample": False, "temperature": None})
    assert resolved([], model_dir) == builtin
    assert read_model_defaults(str(model_dir / "model.gguf")) == ({}, None)  # a file: no directory to read
    assert read_model_defaults(None) == ({}, None)


def test_an_unusable_model_value_is_noted_and_left_out(model_dir: Path) -> None:
    values = {"temperature": 5.0, "top_p": "high", "min_p": 0.05}
    generation, sources = resolve_sampling(GenerationConfig(), values)
    by_name = {s.name: s for s in sources}
    assert (generation.temperature, by_name["temperature"].source) == (0.7, "built-in")
    assert "temperature = 5.0" in str(by_name["temperature"].note)
    assert (generation.top_p, by_name["top_p"].source) == (0.95, "built-in") and by_name["top_p"].note
    assert (generation.min_p, by_name["min_p"].source) == (0.05, "model") and by_name["min_p"].note is None
    (model_dir / "generation_config.json").write_text("{not json")
    values, problem = read_model_defaults(str(model_dir))
    assert values == {} and problem is not None and "generation_config.json" in problem


def test_the_engine_gets_only_the_sampling_that_is_on() -> None:
    assert GenerationConfig().engine_sampling() == {}
    generation, _ = resolve_sampling(GenerationConfig(), {"top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05})
    assert generation.engine_sampling() == {"top_k": 20, "repetition_penalty": 1.05}


def test_the_configuration_shows_unset_defaults_as_unset(model_dir: Path) -> None:
    """--check-config, config.example.toml and docs/configuration.md: a default the model
    gives is not shown as a value (copying the example must not pin 0.7)."""
    config, _ = load_config(["--model", str(model_dir), "--top-p", "0.9"], environ={})
    shown = render_toml(config.masked(), comments=False)
    assert "# temperature = 0.7   (unset: the model's generation_config.json value, else this)" in shown
    assert "\ntop_p = 0.9\n" in shown
    example = example_config()
    assert "\n# temperature = 0.7   (unset" in example and "\ntemperature =" not in example
    assert "| `temperature` | `--temperature` `WORKER_TEMPERATURE` | the model's, else `0.7` |" in reference_markdown()
    assert WorkerConfig().generation.unset_model_defaults() == [
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
    ]


# ---- the prepared demo model


def fake_prepared(target: Path) -> Path:
    """A directory that passes for prepared by worker.prepare_model before it wrote the sampling."""
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"")
    (target / models.PREPARED).write_text(json.dumps({"gguf_sha256": models.SMOLLM2.gguf_sha256}))
    (target / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return target


def test_the_prepared_model_carries_the_cards_sampling(tmp_path: Path) -> None:
    """A directory prepared before gets it added, once, keeping what its file had."""
    target = fake_prepared(tmp_path / "smollm2")
    said: list[str] = []
    assert models.prepare("smollm2", target, log=said.append) == target
    config = json.loads((target / "generation_config.json").read_text())
    assert config == {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.2, "top_p": 0.9, "do_sample": True}
    assert said and "recommended sampling" in said[0]
    assert read_model_defaults(str(target)) == ({"temperature": 0.2, "top_p": 0.9}, None)
    said.clear()
    models.prepare("smollm2", target, log=said.append)
    assert said == []  # already there: nothing written
    assert sorted(p.name for p in target.iterdir()) == ["generation_config.json", "model.safetensors", "prepared.json"]

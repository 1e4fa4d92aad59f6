"""The vLLM adapter's structured-output mapping, with a stand-in for vLLM's AsyncLLM (the real
engine is exercised end to end in test_e2e.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams, StructuredOutputsParams

from worker.config import EngineConfig
from worker.engine import (
    EngineError,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    SamplingOptions,
    StructuredOutput,
    StructuredOutputRejected,
)
from worker.vllm_engine import VllmEngine, engine_arguments, make_engine_args, structured_outputs_args

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}


class StandInLLM:
    """Raises ``error`` from generate, or ends the request with ``finish_reason``."""

    def __init__(self, error: Exception | None = None, finish_reason: str = "stop") -> None:
        self.error = error
        self.finish_reason = finish_reason
        self.params: list[SamplingParams] = []

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str) -> AsyncIterator[Any]:
        self.params.append(params)
        if self.error is not None:
            raise self.error
        completion = SimpleNamespace(token_ids=[], text="", finish_reason=self.finish_reason)
        yield SimpleNamespace(outputs=[completion], num_cached_tokens=0, finished=True)


def generate(llm: StandInLLM, structured: StructuredOutput | None) -> list[Any]:
    engine = VllmEngine(llm, EngineInfo("vllm", "x", "m", 128, 16, True), [7], EngineStats())
    request = GenerationRequest("r1", [1, 2, 3], SamplingOptions(8, 0.7, 0.95, (), structured))

    async def collect() -> list[Any]:
        return [update async for update in engine.generate(request)]

    return asyncio.run(collect())


def test_structured_output_becomes_structured_outputs_params() -> None:
    llm = StandInLLM()
    generate(llm, StructuredOutput(json_schema=SCHEMA))
    generate(llm, StructuredOutput())
    generate(llm, None)
    with_schema, json_object, free = (p.structured_outputs for p in llm.params)
    assert isinstance(with_schema, StructuredOutputsParams) and with_schema.json == SCHEMA
    assert isinstance(json_object, StructuredOutputsParams) and json_object.json_object is True
    assert free is None


def test_engine_refusals_of_a_schema_are_structured_output_rejected() -> None:
    refusal = VLLMValidationError("The provided JSON schema contains features not supported by xgrammar.")
    with pytest.raises(StructuredOutputRejected, match="xgrammar"):
        generate(StandInLLM(error=refusal), StructuredOutput(json_schema=SCHEMA))
    # The same kind of refusal of a free-text request is an ordinary engine error.
    with pytest.raises(EngineError) as err:
        generate(StandInLLM(error=VLLMValidationError("prompt is too long")), None)
    assert not isinstance(err.value, StructuredOutputRejected)
    # A grammar that fails to compile in the engine core ends the request with "error".
    with pytest.raises(StructuredOutputRejected, match="compile"):
        generate(StandInLLM(finish_reason="error"), StructuredOutput())


def test_weight_loading_bars_follow_vllm_level() -> None:
    """vLLM draws progress bars on stderr while it loads the weights: not when its log is quiet
    ([logging] vllm_level above INFO); engine.extra still decides when it names the key."""
    config = EngineConfig(model="m")
    assert "use_tqdm_on_load" not in engine_arguments(config)
    assert engine_arguments(config, progress_bars=False)["use_tqdm_on_load"] is False
    explicit = EngineConfig(model="m", extra={"use_tqdm_on_load": True})
    assert engine_arguments(explicit, progress_bars=False)["use_tqdm_on_load"] is True


def test_structured_outputs_engine_arguments(tiny_model: Path) -> None:
    default = structured_outputs_args({}, True)
    assert default == {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
    assert structured_outputs_args({}, False)["structured_outputs_config"]["disable_any_whitespace"] is False
    # engine.extra's keys win; whitespace control only where the backend supports it.
    user = {"structured_outputs_config": {"disable_any_whitespace": False, "enable_in_reasoning": True}}
    assert structured_outputs_args(user, True)["structured_outputs_config"] == {
        "backend": "xgrammar",
        "disable_any_whitespace": False,
        "enable_in_reasoning": True,
    }
    auto = structured_outputs_args({"structured_outputs_config": {"backend": "auto"}}, True)
    assert auto == {"structured_outputs_config": {"backend": "auto"}}
    args = make_engine_args({"model": str(tiny_model), **default})
    assert args.structured_outputs_config.backend == "xgrammar"
    assert args.structured_outputs_config.disable_any_whitespace is True


def test_is_alive_follows_vllms_engine_dead_flag() -> None:
    # AsyncLLM.errored turns true when vLLM's monitor sees the engine core process exit.
    llm = StandInLLM()
    llm.errored = False  # type: ignore[attr-defined]
    engine = VllmEngine(llm, EngineInfo("vllm", "x", "m", 128, 16, True), [7], EngineStats())
    assert engine.is_alive()
    llm.errored = True  # type: ignore[attr-defined]
    assert not engine.is_alive()

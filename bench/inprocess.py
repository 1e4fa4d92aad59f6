"""vLLM driven directly in this process, without MQTT or the worker: the ceiling the worker is
measured against, the "before" pattern of the script the worker replaces, raw batch-1 decode,
and the engine-settings ablation. Same engine arguments and prompts as the worker's."""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
from typing import Any

from worker.config.models import EngineConfig
from worker.engine.tokenizer import ChatTokenizer

from .common import Record, Workload, history_messages, think_time
from .mqtt_driver import Progress


class InProcess:
    def __init__(self, engine_config: EngineConfig, tokenizer: ChatTokenizer) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        from worker.engine.vllm import engine_arguments, make_engine_args

        self.tokenizer = tokenizer
        started = time.perf_counter()
        self.llm: Any = AsyncLLM.from_engine_args(make_engine_args(engine_arguments(engine_config)))
        self.start_s = round(time.perf_counter() - started, 1)
        # What is alive once the engine is up, out of the collector's reach, as `vllm serve`
        # does after its start (and the worker after its own): raw AsyncLLM as vLLM serves it.
        # Unfrozen, this process spent 955 ms in collections during a 1,000-session burst
        # against the worker's 115 (an H200, BENCH_GC; bench/results/gpu/qwen3-1.7b-burst-h200-goal-O).
        gc.collect()
        gc.freeze()
        self.block_size = int(self.llm.vllm_config.cache_config.block_size)

    def shutdown(self) -> None:
        self.llm.shutdown()
        gc.unfreeze()  # handed back, as the worker does at its stop (the next phase, a test's process)

    async def _generate(
        self,
        token_ids: list[int],
        max_tokens: int,
        *,
        salt: str | None = None,
        ignore_eos: bool = False,
        temperature: float = 0.7,
    ) -> tuple[str, int, int, float, float]:
        """(text, completion tokens, cached tokens, ttft s, total s) of one request."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=0.95,
            stop_token_ids=None if ignore_eos else self.tokenizer.stop_token_ids,
            ignore_eos=ignore_eos,
            output_kind=RequestOutputKind.DELTA,
        )
        prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
        if salt:
            prompt["cache_salt"] = salt
        started = time.perf_counter()
        first: float | None = None
        parts: list[str] = []
        completion = cached = 0
        async for output in self.llm.generate(prompt, params, uuid.uuid4().hex):
            piece = output.outputs[0]
            if first is None and piece.token_ids:
                first = time.perf_counter()
            completion += len(piece.token_ids)
            cached = int(output.num_cached_tokens or 0)
            parts.append(piece.text)
        end = time.perf_counter()
        return "".join(parts), completion, cached, (first or end) - started, end - started

    async def _turn(
        self,
        label: str,
        concurrency: int,
        index: int,
        turn: int,
        workload: Workload,
        history: list[tuple[str, str]],
        max_tokens: int,
        **options: Any,
    ) -> Record:
        """One turn of a session: render the conversation, generate, append the reply."""
        message = workload.user_message(index, turn, self.tokenizer.count_text)
        ids = self.tokenizer.render(history_messages(workload, history, message), add_generation_prompt=True)
        text, completion, cached, ttft, total = await self._generate(ids, max_tokens, **options)
        history.append((message, text))
        return Record(
            label,
            concurrency,
            index,
            turn,
            round(total * 1000, 2),
            round(ttft * 1000, 2),
            prompt_tokens=len(ids),
            cached_tokens=cached,
            completion_tokens=completion,
        )

    async def sessions(
        self,
        label: str,
        workload: Workload,
        *,
        sessions: int,
        turns: int,
        max_tokens: int | None = None,
        think_s: float = 0.0,
        progress: Progress | None = None,
    ) -> list[Record]:
        """The worker's concurrent workload, minus MQTT and the worker (the same think times)."""
        records: list[Record] = []

        async def session(index: int) -> None:
            history: list[tuple[str, str]] = []
            for turn in range(turns):
                if turn:
                    await asyncio.sleep(think_time(think_s, index, turn))
                records.append(
                    await self._turn(label, sessions, index, turn, workload, history, max_tokens or workload.max_tokens)
                )
                if progress:
                    progress(1)

        await asyncio.gather(*(session(i) for i in range(sessions)))
        return records

    async def before(
        self, workload: Workload, *, turns: int, max_tokens: int = 512, progress: Progress | None = None
    ) -> list[Record]:
        """The script this worker replaces: the whole conversation every turn, nothing reused
        (a unique cache_salt per request), maxTokens 512, no stop (ignore_eos)."""
        records: list[Record] = []
        history: list[tuple[str, str]] = []
        for turn in range(turns):
            records.append(
                await self._turn(
                    "before", 1, 0, turn, workload, history, max_tokens, salt=uuid.uuid4().hex, ignore_eos=True
                )
            )
            if progress:
                progress(1)
        return records

    async def decode_rate(self, workload: Workload, *, max_tokens: int, batch: int = 1) -> dict[str, float]:
        """Decode tokens/s of ``batch`` requests at once (ignore_eos: every one runs to max_tokens)."""
        ids = self.tokenizer.render(history_messages(workload, [], "Tell me a long story."), add_generation_prompt=True)
        await self._generate(ids, 8, ignore_eos=True)  # warm up this shape
        results = await asyncio.gather(
            *(self._generate(ids, max_tokens, ignore_eos=True, salt=uuid.uuid4().hex) for _ in range(batch))
        )
        per_request = [(n - 1) / (total - ttft) for _, n, _, ttft, total in results if total > ttft]
        wall = max(total for *_, total in results)
        return {
            "batch": batch,
            "decode_tok_per_s_per_request": round(sum(per_request) / len(per_request), 1),
            "aggregate_tok_per_s": round(sum(n for _, n, *_ in results) / wall, 1),
        }

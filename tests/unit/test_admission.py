"""Admission (worker/engine/admission.py): the policy as a function of the engine's load, and
the door's order: users in turn, nothing held while the engine has room."""

from __future__ import annotations

import asyncio

import pytest

from worker.engine.admission import (
    MIN_UNCACHED,
    Admission,
    AdmissionLimits,
    EngineLoad,
    admission_limits,
    may_admit,
    session_of,
)

H100 = admission_limits(1024)  # the worker's default on an H100: max_num_seqs 1024
H100_TOKENS = admission_limits(1024, waiting_tokens=32768)  # with a bound on prompt waiting for prefill
_TASKS: list[asyncio.Task[None]] = []


def test_defaults_follow_the_scheduler_limits() -> None:
    assert AdmissionLimits(max_num_seqs=1024, waiting_requests=128, waiting_tokens=None) == H100
    assert admission_limits(64) == AdmissionLimits(64, 16, None)  # at least 16 waiting
    assert admission_limits(1024, waiting_requests=0, waiting_tokens=5000) == AdmissionLimits(1024, 0, 5000)


def test_an_idle_engine_takes_any_prompt() -> None:
    assert may_admit(EngineLoad(), 100_000, H100_TOKENS)  # longer than waiting_tokens: nothing else waits
    assert may_admit(EngineLoad(in_engine=500, unstarted=0, unstarted_tokens=0), 100_000, H100_TOKENS)


def test_by_default_every_request_goes_while_the_engine_has_sequences() -> None:
    """vLLM's own queue fills each step's token budget: the worker holds nothing back below
    max_num_seqs + waiting_requests, however much prompt waits in the engine."""
    assert may_admit(EngineLoad(in_engine=999, unstarted=999, unstarted_tokens=300_000), 300, H100)
    assert not may_admit(EngineLoad(in_engine=1152, unstarted=500, unstarted_tokens=150_000), 300, H100)


def test_prompt_tokens_waiting_in_the_engine_bound_it_where_set() -> None:
    load = EngineLoad(in_engine=100, unstarted=100, unstarted_tokens=32_000)
    assert may_admit(load, 768, H100_TOKENS)  # exactly the bound
    assert not may_admit(load, 769, H100_TOKENS)
    assert not may_admit(EngineLoad(in_engine=10, unstarted=10, unstarted_tokens=32_768), 1, H100_TOKENS)


def test_sequences_bound_it_beyond_max_num_seqs() -> None:
    assert may_admit(EngineLoad(in_engine=1024 + 127), 300, H100)  # all running: 127 queued so far
    assert not may_admit(EngineLoad(in_engine=1024 + 128), 300, H100)
    assert not may_admit(EngineLoad(in_engine=1024 + 128, unstarted=0), 1, H100)


def test_no_request_waits_while_the_engine_has_a_free_sequence() -> None:
    """By default the worker holds a request only when every sequence of the engine is taken
    and waiting_requests more wait there; with waiting_tokens set, also when that much prompt
    waits for its prefill in the engine."""
    for limits in (admission_limits(256), admission_limits(256, waiting_tokens=8192)):
        for in_engine in range(0, 400, 7):
            for unstarted in range(0, min(in_engine, 60) + 1, 5):
                for tokens in (0, 1000, 4000, 8191, 8192, 50_000):
                    load = EngineLoad(in_engine, unstarted, tokens if unstarted else 0)
                    if not may_admit(load, 300, limits):
                        bound = limits.waiting_tokens
                        assert in_engine >= 256 + 32 or (bound is not None and tokens + 300 > bound)


def test_session_of_reads_the_worker_request_ids() -> None:
    assert session_of("alice/s1/r-7/3") == ("alice", "alice/s1")
    assert session_of("warmup-0-1") == ("warmup-0-1", "warmup-0-1")


async def _enter_all(admission: Admission, ids: list[str], tokens: int) -> list[str]:
    """Start a waiter for each id in order; the ids admitted so far, in their order."""
    order: list[str] = []
    tasks = _TASKS  # kept: a task only weakly referenced by the loop may be collected

    async def one(request_id: str) -> None:
        if await admission.enter(request_id, tokens):
            order.append(request_id)

    for request_id in ids:
        tasks.append(asyncio.ensure_future(one(request_id)))
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    return order


def test_waiting_requests_go_users_in_turn() -> None:
    asyncio.run(_test_waiting_requests_go_users_in_turn())


async def _test_waiting_requests_go_users_in_turn() -> None:
    admission = Admission(AdmissionLimits(max_num_seqs=2, waiting_requests=0, waiting_tokens=10_000))
    ids = [f"bulk/s{i}/r/1" for i in range(6)] + ["alice/a/r/1", "bob/b/r/1"]
    order = await _enter_all(admission, ids, 10)
    assert order == ["bulk/s0/r/1", "bulk/s1/r/1"]
    assert admission.held == 6
    for done in list(order):  # each finished request frees a sequence for the next user's
        admission.started(done)
        admission.leave(done, 10, 5)
        await asyncio.sleep(0)
    assert order[2:] == ["bulk/s2/r/1", "alice/a/r/1"]
    admission.leave("bulk/s2/r/1")
    await asyncio.sleep(0)
    assert order[4] == "bob/b/r/1"  # one of bulk's, alice's, bob's, then bulk's again
    admission.leave("alice/a/r/1")
    await asyncio.sleep(0)
    assert order[5] == "bulk/s3/r/1"


def test_first_tokens_release_prompts_that_waited_for_prefill_room() -> None:
    asyncio.run(_test_first_tokens_release_prompts_that_waited_for_prefill_room())


async def _test_first_tokens_release_prompts_that_waited_for_prefill_room() -> None:
    admission = Admission(AdmissionLimits(max_num_seqs=100, waiting_requests=0, waiting_tokens=1000))
    order = await _enter_all(admission, [f"u/s{i}/r/1" for i in range(5)], 400)
    assert order == ["u/s0/r/1", "u/s1/r/1"]  # 800 tokens waiting for their prefill; 1,200 is over
    admission.started("u/s0/r/1")
    await asyncio.sleep(0)
    assert order == ["u/s0/r/1", "u/s1/r/1", "u/s2/r/1"]
    assert admission.load == EngineLoad(in_engine=3, unstarted=2, unstarted_tokens=800)


def test_a_cancelled_waiting_request_never_reaches_the_engine() -> None:
    asyncio.run(_test_a_cancelled_waiting_request_never_reaches_the_engine())


async def _test_a_cancelled_waiting_request_never_reaches_the_engine() -> None:
    admission = Admission(AdmissionLimits(max_num_seqs=1, waiting_requests=0, waiting_tokens=1000))
    assert await admission.enter("u/a/r/1", 10)
    waiter = asyncio.ensure_future(admission.enter("u/b/r/1", 10))
    await asyncio.sleep(0)
    assert admission.held == 1
    assert admission.cancel("u/b/r/1")
    assert await waiter is False
    assert admission.held == 0
    assert not admission.cancel("u/a/r/1")  # in the engine: the engine aborts it
    admission.leave("u/b/r/1")  # the caller's leave after a cancel changes nothing
    assert admission.load == EngineLoad(in_engine=1, unstarted=1, unstarted_tokens=10)


def test_a_waiter_whose_task_is_cancelled_leaves_the_queue() -> None:
    asyncio.run(_test_a_waiter_whose_task_is_cancelled_leaves_the_queue())


async def _test_a_waiter_whose_task_is_cancelled_leaves_the_queue() -> None:
    admission = Admission(AdmissionLimits(max_num_seqs=1, waiting_requests=0, waiting_tokens=1000))
    assert await admission.enter("u/a/r/1", 10)
    waiter = asyncio.ensure_future(admission.enter("v/b/r/1", 10))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    admission.leave("v/b/r/1")
    assert admission.held == 0
    admission.leave("u/a/r/1")
    assert admission.load == EngineLoad()


def test_a_returning_session_counts_only_its_new_tokens() -> None:
    asyncio.run(_test_a_returning_session_counts_only_its_new_tokens())


async def _test_a_returning_session_counts_only_its_new_tokens() -> None:
    admission = Admission(admission_limits(64, waiting_tokens=8192))
    assert await admission.enter("u/a/r/1", 2000)
    assert admission.load.unstarted_tokens == 2000
    admission.started("u/a/r/1")
    admission.leave("u/a/r/1", 2000, 200)
    # The next turn's prompt holds the last prompt and reply: the prefix cache likely has them.
    assert admission.estimate("u/a/r/2", 2300) == 100
    assert admission.estimate("u/a/r/2", 2210) == MIN_UNCACHED
    assert admission.estimate("u/other/r/1", 2300) == 2300

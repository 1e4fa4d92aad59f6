"""The engine's image settings (worker/engine/vllm.py): the arguments a vision model's engine
gets, the processor cache's size from the host's memory, and the placeholder count, each
without starting an engine (tests/engine/test_vision.py runs them on the real one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.config.models import EngineConfig
from worker.engine.kvtier import GIB, HostMemory
from worker.engine.port import ImagesRejected, VisionInfo, VisionSettings
from worker.engine.vllm import (
    Host,
    ImageThreads,
    check_image_placeholders,
    engine_arguments,
    image_threads,
    processor_cache_gib,
    processor_size,
    vision_arguments,
)


def cpu_host(available_gib: float) -> Host:
    memory = HostMemory(total=int(64 * GIB), available=int(available_gib * GIB))
    return Host(cpu_backend=True, memory_gib=64, gpus=1, memory=memory)


@pytest.mark.parametrize(
    ("available", "gib"),
    [
        (20, 1.25),  # the 24 GiB CI machine: 1/16 of what is available, per process
        (256, 4.0),  # a GPU host: vLLM's own default is the most
        (2, 0.25),  # a small host: never below a quarter GiB
        (13, 0.75),  # steps of a quarter GiB, rounded down
    ],
)
def test_the_processor_cache_is_sized_from_the_available_memory(available: float, gib: float) -> None:
    assert processor_cache_gib(cpu_host(available)) == gib


def test_vision_arguments() -> None:
    settings = VisionSettings(max_pixels=500_000, max_images_in_prompt=3)
    assert vision_arguments(settings, cpu_host(20)) == {
        "limit_mm_per_prompt": {"image": 3, "video": 0},
        "mm_processor_kwargs": {"max_pixels": 500_000},
        "mm_processor_cache_gb": 1.25,
    }
    chosen = VisionSettings(processor_cache_gib=0.5)
    assert vision_arguments(chosen, cpu_host(20))["mm_processor_cache_gb"] == 0.5


@pytest.mark.parametrize(
    ("preprocessor", "expected"),
    [
        # Qwen2-VL and Qwen3-VL today: pixel counts in size; the model's own lower bound stays
        (
            {"size": {"shortest_edge": 3136, "longest_edge": 12845056}},
            {"size": {"shortest_edge": 3136, "longest_edge": 500_000}},
        ),
        (
            {"size": {"shortest_edge": 65536, "longest_edge": 16777216}},
            {"size": {"shortest_edge": 65536, "longest_edge": 500_000}},
        ),
        # older Qwen2-VL configurations
        ({"min_pixels": 3136, "max_pixels": 12845056}, {"size": {"shortest_edge": 3136, "longest_edge": 500_000}}),
        # a lower bound above the configured most is lowered to it
        (
            {"size": {"shortest_edge": 600_000, "longest_edge": 12845056}},
            {"size": {"shortest_edge": 500_000, "longest_edge": 500_000}},
        ),
        # CLIP-style processors (edge lengths, no longest_edge), none, or unreadable: max_pixels
        ({"size": {"shortest_edge": 336}}, {"max_pixels": 500_000}),
        (None, {"max_pixels": 500_000}),
        ("{not json", {"max_pixels": 500_000}),
    ],
)
def test_an_image_is_bounded_by_size_where_the_processor_counts_pixels(
    tmp_path: Path, preprocessor: object, expected: dict[str, object]
) -> None:
    """transformers 5 warns at every processor call given max_pixels (deprecated) and refuses a
    size with one edge: a Qwen-VL processor gets both edges, its own lower bound kept."""
    if preprocessor is not None:
        text = preprocessor if isinstance(preprocessor, str) else json.dumps(preprocessor)
        (tmp_path / "preprocessor_config.json").write_text(text)
    settings = VisionSettings(max_pixels=500_000)
    assert processor_size(500_000, str(tmp_path)) == expected
    assert vision_arguments(settings, cpu_host(20), model=str(tmp_path))["mm_processor_kwargs"] == expected


def test_images_are_processed_on_one_thread_with_the_processor_cache_by_default() -> None:
    assert image_threads(VisionSettings()) == ImageThreads(1, "the default")
    arguments = vision_arguments(VisionSettings(), cpu_host(20))
    assert arguments["mm_processor_cache_gb"] == 1.25 and "renderer_num_workers" not in arguments
    assert image_threads(VisionSettings(image_threads=1), {"mm_processor_cache_gb": 2}).count == 1


def test_several_image_threads_turn_the_processor_cache_off() -> None:
    """vLLM's processor cache is not thread-safe: off with several threads, and vLLM's renderer
    gets as many workers (the threads that process images where vLLM does it itself)."""
    chosen = VisionSettings(image_threads=3)
    assert image_threads(chosen) == ImageThreads(3, "vision.image_threads")
    arguments = vision_arguments(chosen, cpu_host(20))
    assert arguments["mm_processor_cache_gb"] == 0 and arguments["renderer_num_workers"] == 3
    kwargs = engine_arguments(EngineConfig(model="m"), host=cpu_host(20), vision=chosen)
    assert kwargs["mm_processor_cache_gb"] == 0 and kwargs["renderer_num_workers"] == 3
    # engine.extra's mm_processor_cache_gb 0 is no cache: the threads stay
    assert image_threads(chosen, {"mm_processor_cache_gb": 0}).count == 3


def test_several_image_threads_and_a_processor_cache_are_refused() -> None:
    config = EngineConfig(model="m", extra={"mm_processor_cache_gb": 2})
    with pytest.raises(ValueError, match=r"vision\.image_threads 2 needs vLLM's processor cache off"):
        engine_arguments(config, host=cpu_host(20), vision=VisionSettings(image_threads=2))
    with pytest.raises(ValueError, match=r"the image settings set 0\.5 GiB"):
        image_threads(VisionSettings(image_threads=2, processor_cache_gib=0.5))


def test_engine_extra_wins_over_the_vision_settings() -> None:
    config = EngineConfig(model="m", extra={"mm_processor_cache_gb": 0, "limit_mm_per_prompt": {"image": 1}})
    kwargs = engine_arguments(config, host=cpu_host(20), vision=VisionSettings(max_pixels=100_000))
    assert kwargs["mm_processor_cache_gb"] == 0
    assert kwargs["limit_mm_per_prompt"] == {"image": 1}
    assert kwargs["mm_processor_kwargs"] == {"max_pixels": 100_000}


QWEN = VisionInfo(image_token_id=7, placeholder=(6, 7, 8), max_images=2, max_pixels=None)


@pytest.mark.parametrize(
    ("ids", "images", "words"),
    [
        ([1, 6, 7, 8, 2], 1, None),
        ([1, 6, 7, 8, 2, 6, 7, 8], 2, None),
        ([1, 2], 0, None),
        ([1, 2], 1, "0 image placeholder tokens for 1 image"),
        ([1, 6, 7, 8, 6, 7, 8], 1, "2 image placeholder tokens for 1 image"),
        ([1, 6, 7, 7, 7, 8], 1, "3 image placeholder tokens for 1 image"),  # already expanded
        ([7, 8, 1], 1, "not the model's whole placeholder"),  # at the start: no vision start before it
        ([1, 6, 7, 2], 1, "not the model's whole placeholder"),
        ([1, 6, 7, 8, 6, 7, 8, 6, 7, 8], 3, "3 images in one prompt: the model m takes at most 2"),
    ],
)
def test_placeholders_are_counted(ids: list[int], images: int, words: str | None) -> None:
    if words is None:
        check_image_placeholders(ids, images, QWEN, "m")
    else:
        with pytest.raises(ImagesRejected, match=words):
            check_image_placeholders(ids, images, QWEN, "m")


def test_a_model_with_a_bare_image_token() -> None:
    llava = VisionInfo(image_token_id=9, placeholder=(9,), max_images=4, max_pixels=None)
    check_image_placeholders([1, 9, 2, 9], 2, llava, "m")
    with pytest.raises(ImagesRejected):
        check_image_placeholders([1, 9, 9], 1, llava, "m")


def test_the_start_line_says_which_threads_process_images_and_the_cache() -> None:
    from types import SimpleNamespace

    from worker.engine.vllm import vision_words

    def config(cache: float) -> SimpleNamespace:
        multimodal = SimpleNamespace(mm_processor_cache_gb=cache)
        return SimpleNamespace(model_config=SimpleNamespace(multimodal_config=multimodal))

    vision = VisionInfo(image_token_id=7, placeholder=(6, 7, 8), max_images=8, max_pixels=1048576)
    assert vision_words(vision, config(1.25), image_threads(VisionSettings())) == (
        "up to 8 per prompt, each scaled to at most 1,048,576 pixels, processed on one thread (the default), "
        "processor cache 1.25 GiB per process"
    )
    assert vision_words(vision, config(0), image_threads(VisionSettings(image_threads=4))) == (
        "up to 8 per prompt, each scaled to at most 1,048,576 pixels, processed on 4 threads "
        "(vision.image_threads), processor cache off (an image that a session's history sends again is "
        "processed again)"
    )


def test_the_torch_threads_per_image_come_from_omp_the_settings_or_the_host() -> None:
    """The operator's OMP_NUM_THREADS (what vLLM reads) wins; then vision.image_torch_threads; by
    default a quarter of a GPU host's CPUs, at most 4, and one on the CPU backend."""
    from worker.engine.vllm import image_torch_threads

    gpu_host = {"cpu_backend": False, "cpus": 16}
    assert image_torch_threads(VisionSettings(), **gpu_host, environ={}) == ImageThreads(
        4, "a quarter of the host's 16 CPUs, at most 4"
    )
    assert image_torch_threads(VisionSettings(), cpu_backend=False, cpus=64, environ={}).count == 4
    assert image_torch_threads(VisionSettings(), cpu_backend=False, cpus=6, environ={}).count == 1
    assert image_torch_threads(VisionSettings(), cpu_backend=True, cpus=64, environ={}).count == 1
    configured = VisionSettings(image_torch_threads=2)
    assert image_torch_threads(configured, **gpu_host, environ={}) == ImageThreads(2, "vision.image_torch_threads")
    omp = image_torch_threads(configured, **gpu_host, environ={"OMP_NUM_THREADS": "8"})
    assert omp == ImageThreads(8, "OMP_NUM_THREADS")
    assert image_torch_threads(configured, **gpu_host, environ={"OMP_NUM_THREADS": "many"}).count == 1

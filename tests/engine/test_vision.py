"""Images through the real vLLM CPU engine (worker/engine/vllm.py), on the tiny random Qwen2-VL
and Qwen3-VL of devtools/tinyvision.py: an image prompt generates and reports its image tokens;
the second turn of a conversation with the same image finds the first turn's blocks, the
image's included, in the prefix cache (and a different image does not); a prompt whose
placeholders do not match its images is refused before vLLM sees it. One engine start
(~1-2 min) per model family."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from devtools.tinyvision import (
    IMAGE_PAD,
    TEST_MAX_PIXELS,
    VISION_END,
    VISION_START,
    generate_tiny_vision_model,
    tiny_engine_settings,
)
from devtools.worker_process import BLOCK_SIZE
from worker.engine.port import (
    EngineImage,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    GenerationUpdate,
    ImagesRejected,
    SamplingOptions,
    VisionInfo,
)

pytestmark = pytest.mark.e2e

MAX_TOKENS = 4
IMAGE_THREADS = 2
# How long one image's processing waits for the other's at the tests' barrier before it gives
# up (and the test fails): only a bound for a failure, never reached when they overlap.
BARRIER_TIMEOUT_S = 120.0
MAX_PIXELS = TEST_MAX_PIXELS
# The tokens of a 300x200 picture at MAX_PIXELS: scaled (keeping its aspect) in steps of one
# token's pixels, 28 (Qwen2-VL: 252x168, 9x6 tokens) or 32 (Qwen3-VL: 256x160, 8x5 tokens).
IMAGE_TOKENS = {"qwen2-vl": 54, "qwen3-vl": 40}


class Engine:
    """The engine on its own event loop in a thread: the module's tests share one start."""

    def __init__(self, model: Path) -> None:
        from worker.engine.vllm import VllmEngine

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        # Two image threads (and so no processor cache), the tests below process two at once.
        config, settings = tiny_engine_settings(model, image_threads=IMAGE_THREADS)
        self.engine = self.run(VllmEngine.start(config, stop_token_ids=[], progress_bars=False, vision=settings))

    def run(self, coroutine: Any, timeout: float = 600) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def generate(self, ids: list[int], images: list[EngineImage], request_id: str) -> GenerationUpdate:
        result: GenerationUpdate = self.generate_all([(ids, images, request_id)])[0]
        return result

    def generate_all(self, requests: list[tuple[list[int], list[EngineImage], str]]) -> list[GenerationUpdate]:
        """The requests at once, each generated to its end."""

        async def collect(ids: list[int], images: list[EngineImage], request_id: str) -> GenerationUpdate:
            sampling = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0)
            last = None
            async for update in self.engine.generate(GenerationRequest(request_id, ids, sampling, tuple(images))):
                last = update
            assert last is not None and last.finished
            return last

        async def every() -> list[GenerationUpdate]:
            return list(await asyncio.gather(*(collect(*request) for request in requests)))

        result: list[GenerationUpdate] = self.run(every())
        return result

    def close(self) -> None:
        self.run(self.engine.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture(scope="module", params=["qwen2-vl", "qwen3-vl"])
def family(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory: pytest.TempPathFactory, family: str) -> Path:
    return generate_tiny_vision_model(tmp_path_factory.mktemp(f"tiny-{family}"), family=family)


@pytest.fixture(scope="module")
def engine(vision_model: Path) -> Iterator[Engine]:
    started = Engine(vision_model)
    try:
        yield started
    finally:
        started.close()


@pytest.fixture(scope="module")
def template(vision_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(vision_model))


def picture(seed: int, size: tuple[int, int] = (300, 200)) -> EngineImage:
    """Random pixels (a camera snapshot's stand-in), identified by their content hash."""
    pixels = Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
    return EngineImage(pixels, hashlib.sha256(pixels.tobytes()).hexdigest())


def render(template: Any, messages: list[dict[str, Any]]) -> list[int]:
    text = template.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids: list[int] = template.encode(text, add_special_tokens=False)
    return ids


# Text after the image, so that the first turn's prompt fills whole blocks past the image.
QUESTION = "Is anyone at the door? Look at the picture of the front door camera and say who is there, if anyone."
FIRST = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


def second_turn(reply: str) -> list[dict[str, Any]]:
    return [*FIRST, {"role": "assistant", "content": reply}, {"role": "user", "content": "And now?"}]


def test_the_engine_knows_the_model_takes_images(engine: Engine, template: Any) -> None:
    vision = engine.engine.info.vision
    placeholder = tuple(template.convert_tokens_to_ids([VISION_START, IMAGE_PAD, VISION_END]))
    assert vision == VisionInfo(
        image_token_id=placeholder[1], placeholder=placeholder, max_images=2, max_pixels=MAX_PIXELS
    )


def test_an_image_prompt_generates_and_counts_its_image_tokens(engine: Engine, template: Any, family: str) -> None:
    ids = render(template, FIRST)
    update = engine.generate(ids, [picture(1)], "image-1")
    assert update.finish_reason == "length" and update.completion_tokens == MAX_TOKENS
    assert update.image_tokens == IMAGE_TOKENS[family]
    assert update.prompt_tokens == len(ids) - 1 + update.image_tokens


def test_the_second_turn_finds_the_first_image_in_the_prefix_cache(engine: Engine, template: Any) -> None:
    image = picture(2)
    first = render(template, FIRST)
    one = engine.generate(first, [image], "cache-1")
    assert one.cached_tokens == 0
    ids = render(template, second_turn("Nobody."))
    two = engine.generate(ids, [image], "cache-2")
    image_end = first.index(template.convert_tokens_to_ids(IMAGE_PAD)) + one.image_tokens
    # Whole blocks are cached: every block before the one the turns part in, the image's included.
    assert one.prompt_tokens >= image_end + BLOCK_SIZE  # (else the test could not tell)
    assert two.cached_tokens >= image_end, (two.cached_tokens, image_end)
    assert two.cached_tokens == (one.prompt_tokens // BLOCK_SIZE) * BLOCK_SIZE
    # The same conversation with another image of the same size: nothing past the text before
    # the image is found (the image's identifier is in its blocks' hashes).
    other = engine.generate(ids, [picture(3)], "cache-3")
    assert other.image_tokens == one.image_tokens
    assert other.cached_tokens < image_end


def test_a_text_prompt_on_the_vision_model(engine: Engine, template: Any) -> None:
    ids = render(template, [{"role": "user", "content": "Hello there"}])
    update = engine.generate(ids, [], "text-1")
    assert update.image_tokens == 0 and update.prompt_tokens == len(ids)


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("image without placeholder", "0 image placeholder tokens for 1 image"),
        ("two placeholders, one image", "2 image placeholder tokens for 1 image"),
        ("placeholder already expanded", "[0-9]+ image placeholder tokens for 1 image"),
        ("pad without its start and end", "not the model's whole placeholder"),
        ("more images than the limit", "3 images in one prompt: the model .* takes at most 2"),
    ],
)
def test_placeholders_that_do_not_match_the_images_are_refused(
    engine: Engine, template: Any, family: str, case: str, words: str
) -> None:
    """vLLM itself expands already-expanded ids again and takes more placeholders than images,
    silently, and fails an image without a placeholder with an AssertionError."""
    ids = render(template, FIRST)
    pad = template.convert_tokens_to_ids(IMAGE_PAD)
    images = [picture(4)]
    if case == "image without placeholder":
        ids = render(template, [{"role": "user", "content": "No image here"}])
    elif case == "two placeholders, one image":
        ids = render(template, [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}])
    elif case == "placeholder already expanded":
        at = ids.index(pad)
        ids = ids[:at] + [pad] * IMAGE_TOKENS[family] + ids[at + 1 :]
    elif case == "pad without its start and end":
        ids = render(template, [{"role": "user", "content": "Look"}])
        ids = [*ids[:2], pad, *ids[2:]]
    else:
        ids = render(template, [{"role": "user", "content": [{"type": "image"}] * 3}])
        images = [picture(5), picture(6), picture(7)]
    with pytest.raises(ImagesRejected, match=words) as refused:
        engine.generate(ids, images, f"refused-{case}")
    assert engine.engine.info.model in str(refused.value)
    # and the engine serves on
    assert engine.generate(render(template, FIRST), [picture(4)], f"after-{case}").image_tokens == IMAGE_TOKENS[family]


def test_a_model_without_vision_refuses_images_naming_the_model() -> None:
    """Refused before the engine is asked (a text model's engine would fail it otherwise)."""
    from worker.engine.vllm import VllmEngine

    engine = VllmEngine(None, EngineInfo("vllm", "0", "models/tiny-text", 2048, 32, True), [], EngineStats())
    request = GenerationRequest("r", [1, 2, 3], SamplingOptions(4, 0.0, 1.0), (picture(8),))

    async def first() -> None:
        async for _ in engine.generate(request):
            pass

    with pytest.raises(ImagesRejected, match="the model models/tiny-text takes no images"):
        asyncio.run(first())


def test_where_vllm_processes_images_on_the_event_loop_the_worker_does_it_on_its_thread(
    engine: Engine, template: Any, family: str
) -> None:
    """vLLM 0.26's add_request runs the HF processor on the event loop; 0.32 has
    process_inputs_async and is left to do it (its renderer's thread). The 0.26 path, taken
    here on 0.32 by hiding process_inputs_async: the images are processed on the worker's own
    thread, and the engine takes the processed request."""
    vllm_engine: Any = engine.engine
    assert vllm_engine._process_inputs is None  # 0.32: vLLM's own thread
    process = vllm_engine._llm.input_processor.process_inputs
    threads: list[str] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return process(*args, **kwargs)

    vllm_engine._process_inputs = spy
    try:
        update = engine.generate(render(template, FIRST), [picture(9)], "image-thread")
    finally:
        vllm_engine._process_inputs = None
    assert update.image_tokens == IMAGE_TOKENS[family] and update.completion_tokens == MAX_TOKENS
    assert len(threads) == 1 and threads[0].startswith("images"), threads


class Meeting:
    """Wraps an image-processing call so that each waits at a barrier for the other: two calls
    meet only if they run at the same time, on two threads. One after the other, the first would
    wait alone until the barrier breaks, and its request would fail."""

    def __init__(self, process: Any) -> None:
        self.process = process
        self.barrier = threading.Barrier(IMAGE_THREADS, timeout=BARRIER_TIMEOUT_S)
        self.threads: list[str] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        self.barrier.wait()
        return self.process(*args, **kwargs)


def test_the_start_line_says_how_many_threads_process_images(engine: Engine) -> None:
    from worker.engine.vllm import vision_words

    vllm_engine: Any = engine.engine
    vllm_config = vllm_engine._llm.vllm_config
    assert vllm_engine.image_threads.count == IMAGE_THREADS
    assert vllm_config.model_config.multimodal_config.mm_processor_cache_gb == 0  # not thread-safe
    words = vision_words(vllm_engine.info.vision, vllm_config, vllm_engine.image_threads)
    assert "processed on 2 threads (vision.image_threads)" in words
    assert "processor cache off" in words


def test_two_images_are_processed_at_once_by_vllm(engine: Engine, template: Any, family: str) -> None:
    """Where vLLM processes a raw prompt's images itself (0.32+: InputProcessor.process_inputs_async
    on its renderer's workers), it has as many workers as the worker's image threads."""
    vllm_engine: Any = engine.engine
    assert vllm_engine._process_inputs is None  # 0.32: vLLM's own threads
    renderer = vllm_engine._llm.input_processor.renderer
    meeting = Meeting(renderer._process_multimodal)
    renderer._process_multimodal = meeting
    try:
        ids = render(template, FIRST)
        updates = engine.generate_all([(ids, [picture(20 + i)], f"vllm-together-{i}") for i in range(IMAGE_THREADS)])
    finally:
        del renderer._process_multimodal
    assert [u.image_tokens for u in updates] == [IMAGE_TOKENS[family]] * IMAGE_THREADS
    assert len(set(meeting.threads)) == IMAGE_THREADS, meeting.threads


def test_two_images_are_processed_at_once_on_the_worker_threads(engine: Engine, template: Any, family: str) -> None:
    """Where vLLM would process them on the event loop (0.26, taken here on 0.32 as in the test
    above by hiding process_inputs_async), the worker's image threads process two requests'
    images at once."""
    vllm_engine: Any = engine.engine
    meeting = Meeting(vllm_engine._llm.input_processor.process_inputs)
    vllm_engine._process_inputs = meeting
    try:
        ids = render(template, FIRST)
        updates = engine.generate_all([(ids, [picture(30 + i)], f"own-together-{i}") for i in range(IMAGE_THREADS)])
    finally:
        vllm_engine._process_inputs = None
    assert [u.image_tokens for u in updates] == [IMAGE_TOKENS[family]] * IMAGE_THREADS
    assert len(set(meeting.threads)) == IMAGE_THREADS and all(t.startswith("images") for t in meeting.threads)

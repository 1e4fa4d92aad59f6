"""What a user gets at the defaults, through real workers: the real small model's replies in the
terminal chat and in the browser page are English, with the sampling the model's
generation_config.json recommends; and the warm-up logs no ERROR line. (scripts/chat-demo.sh
asks for more: greedy replies with a repetition penalty, docs/benchmarks/demo-model.md.)

The demo model (SmolLM2-135M-Instruct, prepared by ``python -m worker.prepare_model``) at the
worker's built-in temperature 0.7 drifted into word salad and French; its card recommends 0.2
and top_p 0.9, which the prepared directory's generation_config.json carries and the worker
takes for requests that set none. A reply is judged English by the share of its words that are
common English words (``english_share``): 0.4-0.6 for this model's English replies, below 0.15
for its French or word-salad ones (measured over 300 replies, 64 tokens, float32)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from loguru import logger

from devtools.chat_terminal import Chat
from devtools.fakes import FakeEngine
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.replies import ENGLISH_SHARE, english_share
from devtools.waiting import PATIENCE
from devtools.warmup_check import warmup_problems
from devtools.worker_process import REAL_PREFIX, WorkerProcess
from worker.config.models import WorkerConfig
from worker.engine.port import EngineStats, WarmupPlan
from worker.server import Server
from worker.web import page_url, start

pytestmark = pytest.mark.e2e

# Twenty everyday prompts a user tries first, among them the demo's own question.
PROMPTS = [
    "Hello! What can you do?",
    "What is the capital of France?",
    "Tell me a fun fact about cats.",
    "How do I boil an egg?",
    "What is the weather like on Mars?",
    "Give me a tip for learning to code.",
    "Why is the sky blue?",
    "What should I cook for dinner tonight?",
    "Recommend a good book.",
    "How many days are in a year?",
    "What is photosynthesis?",
    "Write one sentence about the sea.",
    "What is your favourite colour?",
    "How do airplanes fly?",
    "What is a good name for a dog?",
    "Explain what a computer is.",
    "What can I do on a rainy day?",
    "How do I stay healthy?",
    "What is the tallest mountain?",
    "Say something nice about Mondays.",
]
MAX_TOKENS = 32  # about 25 words: enough to tell the language, short enough for 40 replies

ENGLISH_REPLIES = 17  # of 20: one prompt (France's capital) starts in French at about 0.4 odds


def test_the_judge_tells_english_from_what_the_model_said_otherwise() -> None:
    """Replies of this model seen at temperature 0.7 and 0.2 (the judge's counterpart)."""
    english = [
        "The capital of France is Paris.",
        "A rainy day can be a wonderful opportunity to relax and enjoy the beauty of nature.",
        "The sky is blue because of a process called Rayleigh scattering, which occurs when light",
    ]
    not_english = [
        "L'Étoile, la Marseillaise, la femme au roi, la femme au roi. La capital de France est l'Etoile de Paris.",
        "LONDON, LONDON, UK - France - Paris - Le Parc de la France - France - France - Paris - Londè",
        "Mmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmm",
        "Tofu.101.2023.10.2023.2023.2023.2023",
    ]
    assert all(english_share(text) >= ENGLISH_SHARE for text in english)
    assert all(english_share(text) < ENGLISH_SHARE for text in not_english)


def test_the_warm_up_logs_no_error(shared_worker: WorkerProcess) -> None:
    """The shared worker warms up (--warmup on, batches 1-4, vLLM's own lines at INFO) before
    it is online: no ERROR line (the worker's or vLLM's), every step done. On a GPU the same
    check is ``python -m devtools.warmup_check MODEL``."""
    shared_worker.wait_log("worker.server: Serving ")  # it comes with the SUBACK, maybe after "online"
    assert warmup_problems(shared_worker.log()) == []


# ---- the server resolves the defaults once, at start, for the engine, the warm-up and requests


class ServedFakeEngine(FakeEngine):
    """devtools' fake engine with what the server needs beyond the service's port; records
    the warm-up's plan."""

    def __init__(self) -> None:
        super().__init__()
        self.plans: list[WarmupPlan] = []

    def is_alive(self) -> bool:
        return True

    async def warm_up(self, plan: WarmupPlan) -> None:
        self.plans.append(plan)

    def peek_stats(self) -> EngineStats:
        return EngineStats()

    async def shutdown(self) -> None:
        pass


def test_the_server_hands_the_models_defaults_to_the_engine_the_warm_up_and_requests(
    broker: Mosquitto, tiny_model: Path, tmp_path: Path
) -> None:
    """A model directory whose generation_config.json sets sampling (the tiny model's sets
    none), a worker that sets only top_p: the model's temperature and top_k, the worker's
    top_p, the built-in rest. (No vLLM engine: the server's ``start_engine`` hook.)"""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config_file = model / "generation_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "temperature": 0.3, "top_k": 20}))
    config = WorkerConfig.model_validate(
        {
            "engine": {"model": str(model)},
            "generation": {"top_p": 0.8},
            "mqtt": {"port": broker.port, "topic_prefix": "defaults", "worker_id": "defaults", "session_expiry": 0},
            "history": {"store": "memory"},
            "stats": {"interval": 0},
        }
    )
    engine = ServedFakeEngine()
    started_with: list[WorkerConfig] = []

    async def start_engine(config: WorkerConfig, stop_token_ids: list[int]) -> ServedFakeEngine:
        started_with.append(config)
        return engine

    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(message.record["message"]), level="INFO")
    client = Client(broker.port, ["defaults/+/+/reply", "defaults/_worker/defaults/status"])
    try:

        async def ask_then_stop() -> None:
            await asyncio.to_thread(client.wait_for, lambda m: m.payload == b"online", 60)
            client.publish("defaults/u/s1/request", {"message": "hi", "maxTokens": 2})
            client.publish("defaults/u/s2/request", {"message": "hi", "maxTokens": 2, "temperature": 0, "topP": 1})
            for session in ("s1", "s2"):
                await asyncio.to_thread(client.wait_topic, f"defaults/u/{session}/reply", 30)

        assert asyncio.run(Server(config, start_engine=start_engine).serve(ask_then_stop)) == 0
    finally:
        client.close()
        logger.remove(sink)
    assert started_with[0].generation.engine_sampling() == {"top_k": 20}  # the engine applies it to every request
    assert [(p.temperature, p.top_p) for p in engine.plans] == [(0.3, 0.8)]
    sampling = {r.request_id.split("/")[1]: (r.sampling.temperature, r.sampling.top_p) for r in engine.requests}
    assert sampling == {"s1": (0.3, 0.8), "s2": (0.0, 1.0)}  # a request's own values come first
    assert (
        "Sampling defaults of requests that set none: temperature=0.3 (generation_config.json), top_p=0.8 (config), "
        "top_k=20 (generation_config.json), min_p=off (built-in), repetition_penalty=off (built-in)"
    ) in lines


# ---- the real model at its defaults, in the terminal chat and in the browser page


@pytest.fixture(scope="module")
def page_server() -> Iterator[str]:
    server, thread = start("127.0.0.1", 0)
    host, port = server.server_address[:2]
    yield f"http://{host}:{port}"
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"):
        options.add_argument(flag)
    options.add_argument("--disable-background-networking")  # a closed network: nothing to reach
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium'}")
    driver = webdriver.Chrome(options=options, service=Service(executable_path="/usr/bin/chromedriver"))
    yield driver
    driver.quit()


def wait(driver: Any, condition: Callable[[Any], Any], what: str, timeout: float = PATIENCE) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(condition, f"waiting for {what}")


def page_replies(driver: Any, page: str, ws_port: int, user: str, session: str) -> list[str]:
    """Each prompt typed into the page as its user would, the page's fields left as they come
    (but Max tokens), each the first of a conversation (Reset after each reply: in one long
    conversation this small model repeats an earlier answer); the replies the page showed."""
    driver.get(page + "/")
    driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    url = page_url("127.0.0.1", int(page.rsplit(":", 1)[1]), f"ws://127.0.0.1:{ws_port}")
    driver.get(f"{url}&user={user}&session={session}&prefix={REAL_PREFIX}")
    driver.find_element("id", "connect").click()
    wait(driver, lambda d: "real online" in d.find_element("id", "worker-status").text, "the worker's status")
    wait(driver, lambda d: d.find_element("id", "send").is_enabled(), "subscribed")
    driver.find_element("css selector", "#options summary").click()
    assert driver.find_element("id", "temperature").get_attribute("value") == ""  # the model's
    field = driver.find_element("id", "max-tokens")
    field.clear()
    field.send_keys(str(MAX_TOKENS))
    shown = """return [...document.querySelectorAll('#transcript article.turn')].map(a => ({
                 status: a.dataset.status, reply: a.querySelector('.reply-text').textContent}))"""
    forgot = "return [...document.querySelectorAll('#transcript p.note')].map(p => p.textContent).join(' ')"
    replies = []
    for prompt in PROMPTS:
        driver.find_element("id", "message").send_keys(prompt + "\n")
        wait(driver, lambda d: len(d.execute_script(shown)) == 1, "the new turn")
        wait(driver, lambda d: d.execute_script(shown)[0]["status"] != "pending", f"the reply to {prompt!r}")
        turn = driver.execute_script(shown)[0]
        assert turn["status"] == "done", turn
        replies.append(str(turn["reply"]))
        driver.find_element("id", "reset").click()
        wait(driver, lambda d: "forgot this conversation" in d.execute_script(forgot), "the reset")
    return replies


def chat_replies(port: int, session: str) -> list[str]:
    """The terminal chat as a user starts it (per-turn stats, a reply length and nothing
    else: the model's sampling), each prompt the first of a conversation (/reset after each reply); the
    replies it showed."""
    chat = Chat(port, "--topic-prefix", REAL_PREFIX, "--show-stats", "--max-tokens", str(MAX_TOKENS))
    chat.child.timeout = PATIENCE
    replies = []
    try:
        for prompt in PROMPTS:
            replies.append(chat.turn(prompt)[0].strip())
            chat.send("/reset")
            chat.expect("session reset: history and system prompt cleared")
        assert chat.quit() == 0
    finally:
        chat.kill()
    return replies


# 40 replies of the real model, bounded in tokens: 120 s on 2 idle cores, and past pytest's
# default 600 s beside `stress --cpu 2` (the model then made 1-2 tokens/s with the page's browser
# and the other workers on the same cores). A ceiling, not a time window: it ends on the replies.
@pytest.mark.timeout(1800)
def test_replies_at_the_defaults_are_english_in_the_chat_and_the_page(
    real_worker: WorkerProcess, broker: Mosquitto, page_server: str, browser: Any
) -> None:
    log = real_worker.log()
    assert re.search(
        r"Sampling defaults of requests that set none: temperature=0\.2 \(generation_config\.json\), "
        r"top_p=0\.9 \(generation_config\.json\), top_k=off \(built-in\)",
        log,
    ), log[:6000]
    requests = Client(broker.port, [f"{REAL_PREFIX}/+/+/request"])
    chat_session, page_session = "demo-" + uuid.uuid4().hex[:10], "page-" + uuid.uuid4().hex[:10]
    results: dict[str, Any] = {}

    def run_chat() -> None:
        try:
            results["chat"] = chat_replies(broker.port, chat_session)
        except BaseException as exc:  # reported by the test's thread
            results["chat"] = exc

    chat_thread = threading.Thread(target=run_chat)  # both at once: one engine batch, half the time
    chat_thread.start()
    try:
        assert broker.ws_port is not None
        page = page_replies(browser, page_server, broker.ws_port, "webuser", page_session)
    finally:
        chat_thread.join(600)
        requests.close()
    chat = results["chat"]
    if isinstance(chat, BaseException):
        raise chat
    # Both asked at the defaults: no sampling value in what they sent.
    sent = [json.loads(requests.messages.get_nowait().payload) for _ in range(requests.messages.qsize())]
    sent = [r for r in sent if "message" in r]  # not the resets (on the control topic anyway)
    assert len(sent) == 2 * len(PROMPTS)
    assert not [r for r in sent if {"temperature", "topP"} & set(r)], sent
    for client, replies in (("chat", chat), ("page", page)):
        shares = [english_share(reply) for reply in replies]
        english = sum(share >= ENGLISH_SHARE for share in shares)
        print(f"{client}: {english} of {len(replies)} replies English, mean share {sum(shares) / len(shares):.2f}")
        for reply, share in zip(replies, shares, strict=True):
            print(f"  {share:.2f} {reply[:100]!r}")
        assert english >= ENGLISH_REPLIES, (client, list(zip(shares, replies, strict=True)))

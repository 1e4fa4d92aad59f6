"""Chat clients over MQTT, as frontends use the worker: sessions that send their next turn
when the previous reply arrives (concurrent), or one request at a time (the pattern this
worker replaces), with client-side timing of the reply and of the first stream delta."""

from __future__ import annotations

import heapq
import json
import queue
import time
import uuid
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt

from devtools.mqtt_client import connect

from .common import Record, Workload, think_time

Progress = Callable[[int], None]


class MqttDriver:
    def __init__(
        self,
        host: str,
        port: int,
        prefix: str = "chat",
        user: str = "bench",
        *,
        replies: bool = True,
        stats: bool = True,
    ) -> None:
        """``replies``/``stats``: whether to receive the sessions' replies and the workers' stats
        (several benchmark clients: each its sessions' replies, one of them the stats)."""
        self.prefix, self.user = prefix, user
        self.events: queue.Queue[tuple[float, str, bytes]] = queue.Queue()
        self.stats: list[dict[str, Any]] = []
        subscriptions = [
            *([(f"{prefix}/{user}/+/reply", 1), (f"{prefix}/{user}/+/stream", 0)] if replies else []),
            *([(f"{prefix}/_worker/+/stats", 1)] if stats else []),
        ]
        self.client = connect(port, subscriptions, on_message=self._on_message, host=host, keepalive=60)
        self.run_id = uuid.uuid4().hex[:6]
        self._runs = 0
        self.last_send_s = 0.0  # how long run_concurrent's last run took to send its first turns
        self.round_walls: list[float] = []  # run_rounds' last run: each round, first send to last reply (s)
        # The same rounds' (first send, last reply) in time.perf_counter(): CLOCK_MONOTONIC on
        # Linux, one clock for every process of the host, so several clients' rounds merge.
        self.round_spans: list[tuple[float, float]] = []

    def _session_names(self, label: str, sessions: int, first: int = 0) -> list[str]:
        """Names no earlier run used (nor another driver's: run_id): a repeated request id would
        be answered from history. ``first``: the index of the first session (several clients)."""
        self._runs += 1
        return [f"{label}-c{sessions}-{i}-{self.run_id}{self._runs}" for i in range(first, first + sessions)]

    def _on_message(self, message: mqtt.MQTTMessage) -> None:
        if message.topic.endswith("/stats"):
            self.stats.append(json.loads(message.payload))
        else:
            self.events.put((time.perf_counter(), message.topic, bytes(message.payload)))

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def _send(self, session: str, payload: dict[str, Any]) -> float:
        sent = time.perf_counter()
        self.client.publish(f"{self.prefix}/{self.user}/{session}/request", json.dumps(payload), qos=1)
        return sent

    def _payloads(self, workload: Workload, sessions: int, turns: int, count_tokens: Any, max_tokens: int,
                  stream: bool, extra: dict[str, Any] | None, followup: Workload | None = None,
                  first: int = 0, stream_every: int = 0) -> dict[tuple[int, int], dict[str, Any]]:  # fmt: skip
        """Every request of a run, built before the first is sent: tokenizing while sending
        would hold the GIL and delay paho's network thread, so a request would leave the
        client later than its timestamp says (seen as 0.7-3 s outliers in bursts of 50).
        ``followup``: the messages of the turns after the first, where not ``workload``'s;
        ``first``: the index of the first session (its messages are those of that index);
        ``stream_every`` N > 0: every Nth session streams besides (run_concurrent)."""
        out: dict[tuple[int, int], dict[str, Any]] = {}
        for index in range(first, first + sessions):
            for turn in range(turns):
                messages = followup if followup is not None and turn > 0 else workload
                payload: dict[str, Any] = {
                    "message": messages.user_message(index, turn, count_tokens),
                    "maxTokens": max_tokens,
                    "stream": stream or (stream_every > 0 and index % stream_every == 0),
                    **(extra or {}),
                }
                if turn == 0:
                    payload["systemPrompt"] = workload.system_prompt
                out[(index, turn)] = payload
        return out

    def _wait_reply(self, first_delta: dict[str, float], timeout: float = 900) -> tuple[float, str, dict[str, Any]]:
        """The next reply; stream deltas seen on the way are noted as first-delta times.
        Raises queue.Empty once ``timeout`` has passed, even while deltas keep arriving: a
        caller with a turn due (think time) must get control back to send it on time."""
        deadline = time.perf_counter() + timeout
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise queue.Empty
            received, topic, raw = self.events.get(timeout=remaining)
            data = json.loads(raw)
            if topic.endswith("/stream"):
                first_delta.setdefault(data["requestId"], received)
                continue
            if "error" in data:
                raise RuntimeError(f"error reply on {topic}: {data}")
            return received, topic.split("/")[-2], data

    def drain(self, seconds: float) -> None:
        """Drop what is still arriving from an aborted run."""
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            try:
                self.events.get(timeout=0.2)
            except queue.Empty:
                return

    def run_concurrent(
        self,
        label: str,
        workload: Workload,
        count_tokens: Any,
        *,
        sessions: int,
        turns: int,
        max_tokens: int | None = None,
        stream: bool = True,
        think_s: float = 0.0,
        extra: dict[str, Any] | None = None,
        progress: Progress | None = None,
        stagger_first: bool = False,
        stream_every: int = 0,
    ) -> list[Record]:
        """``sessions`` chat sessions at once; each sends its next turn when its reply arrives
        (after a think time drawn around ``think_s``, see common.think_time). With
        ``stagger_first`` the first turns too arrive after such a pause instead of all at once.
        ``stream_every`` N > 0: besides ``stream``'s, every Nth session (0, N, 2N, ...) streams,
        so that a burst whose replies are read at their end has a measured TTFT on a sample."""
        max_tokens = max_tokens or workload.max_tokens
        names = self._session_names(label, sessions)
        index_of = {name: i for i, name in enumerate(names)}
        turn_of = dict.fromkeys(names, 0)
        sent_at: dict[str, float] = {}
        first_delta: dict[str, float] = {}
        due: list[tuple[float, str]] = []
        records: list[Record] = []
        payloads = self._payloads(
            workload, sessions, turns, count_tokens, max_tokens, stream, extra, stream_every=stream_every
        )
        start = time.perf_counter()
        for name in names:
            if stagger_first:
                heapq.heappush(due, (start + think_time(think_s, index_of[name], 0), name))
            else:
                sent_at[name] = self._send(name, {**payloads[(index_of[name], 0)], "requestId": f"{name}-t0"})
        self.last_send_s = time.perf_counter() - start
        while len(records) < sessions * turns:
            now = time.perf_counter()
            while due and due[0][0] <= now:
                _, name = heapq.heappop(due)
                payload = payloads[(index_of[name], turn_of[name])]
                sent_at[name] = self._send(name, {**payload, "requestId": f"{name}-t{turn_of[name]}"})
            try:
                received, name, reply = self._wait_reply(
                    first_delta, timeout=max(0.01, due[0][0] - now) if due else 900
                )
            except queue.Empty:
                continue
            records.append(
                _record(
                    label,
                    sessions,
                    index_of[name],
                    turn_of[name],
                    sent_at[name],
                    received,
                    first_delta.pop(reply["requestId"], None),
                    reply,
                )
            )
            if progress:
                progress(1)
            turn_of[name] += 1
            if turn_of[name] < turns:
                pause = think_time(think_s, index_of[name], turn_of[name])
                heapq.heappush(due, (time.perf_counter() + pause, name))
        return records

    def run_rounds(
        self,
        label: str,
        workload: Workload,
        count_tokens: Any,
        *,
        sessions: int,
        turns: int,
        max_tokens: int | None = None,
        stream: bool = True,
        followup: Workload | None = None,
        progress: Progress | None = None,
        first: int = 0,
        before_round: Callable[[int], object] | None = None,
    ) -> list[Record]:
        """``sessions`` users send each turn at the same moment, and the next one once every
        session has its reply: each round arrives at once, with every history of the round
        before it to keep or to lose. ``followup``: the messages of the later turns (short
        ones, say), where not ``workload``'s. Each round's time from its first request sent
        to its last reply is in ``round_walls`` afterwards (seconds), its first send and last
        reply in ``round_spans``. Several clients: ``first``, the index of this client's first
        session (its messages and records are those of sessions first, first + 1, ...), and
        ``before_round(turn)``, called with every request rendered, before a round's first send
        (a barrier that starts the round in every client together)."""
        max_tokens = max_tokens or workload.max_tokens
        names = self._session_names(label, sessions, first)
        index_of = {name: first + i for i, name in enumerate(names)}
        records: list[Record] = []
        first_delta: dict[str, float] = {}
        payloads = self._payloads(workload, sessions, turns, count_tokens, max_tokens, stream, None, followup, first)
        self.round_walls, self.round_spans = [], []
        for turn in range(turns):
            if before_round is not None:
                before_round(turn)
            started = time.perf_counter()
            sent_at = {
                name: self._send(name, {**payloads[(index_of[name], turn)], "requestId": f"{name}-t{turn}"})
                for name in names
            }
            last = started
            for _ in names:
                received, name, reply = self._wait_reply(first_delta)
                last = max(last, received)
                if progress:
                    progress(1)
                records.append(
                    _record(
                        label,
                        sessions,
                        index_of[name],
                        turn,
                        sent_at[name],
                        received,
                        first_delta.pop(reply["requestId"], None),
                        reply,
                    )
                )
            self.round_walls.append(last - started)
            self.round_spans.append((started, last))
        return records

    def run_one_at_a_time(
        self,
        label: str,
        workload: Workload,
        count_tokens: Any,
        *,
        sessions: int,
        turns: int,
        max_tokens: int | None = None,
        progress: Progress | None = None,
    ) -> list[Record]:
        """The pattern this worker replaces: ``sessions`` users send a turn at the same moment,
        and their requests are served one after another. Each latency counts from that moment."""
        max_tokens = max_tokens or workload.max_tokens
        names = self._session_names(label, sessions)
        records: list[Record] = []
        first_delta: dict[str, float] = {}
        payloads = self._payloads(workload, sessions, turns, count_tokens, max_tokens, True, None)
        for turn in range(turns):
            arrived = time.perf_counter()
            for i, name in enumerate(names):
                self._send(name, {**payloads[(i, turn)], "requestId": f"{name}-t{turn}"})
                received, _, reply = self._wait_reply(first_delta)
                records.append(
                    _record(
                        label, sessions, i, turn, arrived, received, first_delta.pop(reply["requestId"], None), reply
                    )
                )
                if progress:
                    progress(1)
        return records

    def ping(self, count: int) -> list[float]:
        """Round trips of a request the worker answers without the engine (an error reply):
        the MQTT hop through the broker plus the worker's dispatch."""
        times = []
        for i in range(count):
            sent = self._send(f"ping-{self.run_id}", {"message": "x", "maxTokens": 10**9, "requestId": f"p{i}"})
            while True:
                received, topic, _ = self.events.get(timeout=30)
                if topic.endswith(f"ping-{self.run_id}/reply"):
                    times.append((received - sent) * 1000)
                    break
        return times


def _record(
    label: str,
    concurrency: int,
    session: int,
    turn: int,
    sent: float,
    received: float,
    first_delta: float | None,
    reply: dict[str, Any],
) -> Record:
    usage, latency = reply["usage"], reply["latency"]
    return Record(
        label=label,
        concurrency=concurrency,
        session=session,
        turn=turn,
        client_ms=round((received - sent) * 1000, 2),
        client_ttft_ms=round((first_delta - sent) * 1000, 2) if first_delta else None,
        worker_queue_ms=latency["queueMs"],
        worker_ttft_ms=latency["ttftMs"],
        worker_total_ms=latency["totalMs"],
        engine_queue_ms=latency.get("engineQueueMs"),
        prefill_ms=latency.get("prefillMs"),
        prompt_tokens=usage["promptTokens"],
        cached_tokens=usage["cachedTokens"],
        completion_tokens=usage["completionTokens"],
        finish_reason=reply["finishReason"],
    )

"""A request's stream deltas (``stream: true``): the text as it is generated, and the events of
the worker's own calls."""

from __future__ import annotations

import time

from ..protocol.messages import StreamDelta, ToolCallOut, ToolEvent
from ..protocol.packets import split_to_fit
from ..transport.port import Publisher


class DeltaStream:
    """A request's stream deltas: the first published at once (the client's time to first
    token), later ones gathered and published at most once per ``interval_s``. One MQTT
    message per token would cost the worker more than a chat display gains from it (measured
    on the CPU: a third of batch-1 decode speed)."""

    def __init__(self, publisher: Publisher, topic: str, request_id: str, interval_s: float) -> None:
        self._publisher = publisher
        self._topic = topic
        self._request_id = request_id
        self._interval = interval_s
        self._pending: list[str] = []
        self._reasoning = False  # what the pending text is: reasoning or answer
        self._seq = 0
        self._last = 0.0

    def add(self, text: str, *, reasoning: bool = False) -> None:
        if reasoning != self._reasoning:
            self.flush()  # a delta carries one kind of text
            self._reasoning = reasoning
        self._pending.append(text)
        if self._seq == 0 or time.monotonic() - self._last >= self._interval:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        limit = self._publisher.payload_limit(self._topic, qos=0)
        payloads = split_to_fit("".join(self._pending), self._delta, self._seq, limit)
        for payload in payloads:
            self._publisher.publish(self._topic, payload, qos=0)
        self._pending.clear()
        self._seq += len(payloads)
        self._last = time.monotonic()

    def announce(self, calls: list[ToolCallOut]) -> None:
        """The event that says the reply calls tools (after the last text delta)."""
        self.flush()
        payload = StreamDelta(request_id=self._request_id, seq=self._seq, delta="", tool_calls=calls).to_json()
        limit = self._publisher.payload_limit(self._topic, qos=0)
        if limit is None or len(payload) <= limit:
            self._publisher.publish(self._topic, payload, qos=0)
            self._seq += 1

    def event(self, event: ToolEvent) -> None:
        """A worker call started or ended: published at once (after the text before it)."""
        self.flush()
        payload = StreamDelta(request_id=self._request_id, seq=self._seq, delta="", tool_event=event).to_json()
        self._publisher.publish(self._topic, payload, qos=0)
        self._seq += 1

    def _delta(self, seq: int, text: str) -> bytes:
        if self._reasoning:
            return StreamDelta(request_id=self._request_id, seq=seq, delta="", reasoning=text).to_json()
        return StreamDelta(request_id=self._request_id, seq=seq, delta=text).to_json()

"""MQTT topic layout. Every topic the worker publishes is built here from validated parts.

<prefix>/<user>/<session>/request   in, QoS 1
<prefix>/<user>/<session>/control   in, QoS 1
<prefix>/<user>/<session>/reply     out, QoS 1
<prefix>/<user>/<session>/stream    out, QoS 0
<prefix>/_worker/<worker_id>/status out, retained
<prefix>/_worker/<worker_id>/stats  out, retained

Workers of one share group (mqtt.share_group) subscribe to the two inbound filters as MQTT 5
shared subscriptions, $share/<group>/<prefix>/+/+/request: the broker hands each message to
one of them. Each keeps its own client id and _worker topics.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..config.models import TOPIC_PART

WORKER_NAMESPACE = "_worker"
TOOLS_NAMESPACE = "_tools"


def tool_responses_topic(topic_prefix: str, worker_id: str) -> str:
    """Where devices answer the worker's calls: ``<prefix>/_tools/<worker_id>/responses``
    (tools/mqtt.py says why it is the same at every start)."""
    return f"{topic_prefix}/{TOOLS_NAMESPACE}/{worker_id}/responses"


class InvalidTopic(ValueError):
    """A topic that is not one of ours or has invalid parts: no reply can be addressed."""


class Inbound(str, Enum):
    REQUEST = "request"
    CONTROL = "control"


@dataclass(frozen=True)
class SessionAddress:
    """A validated (user namespace, session) pair."""

    user: str
    session: str

    def __post_init__(self) -> None:
        for name, part in (("user", self.user), ("session", self.session)):
            if not TOPIC_PART.fullmatch(part):
                raise InvalidTopic(f"{name} {part[:140]!r} does not match {TOPIC_PART.pattern}")
        if self.user.startswith("_"):
            raise InvalidTopic(f"namespace {self.user!r} is reserved")

    def __str__(self) -> str:
        return f"{self.user}/{self.session}"


@dataclass(frozen=True)
class Topics:
    prefix: str = "chat"

    def subscriptions(self, share_group: str | None = None) -> list[str]:
        """The inbound filters; with a share group, as MQTT 5 shared subscriptions: the broker
        delivers each message to one subscriber of the group."""
        share = f"$share/{share_group}/" if share_group else ""
        return [f"{share}{self.prefix}/+/+/{kind.value}" for kind in Inbound]

    def parse(self, topic: str) -> tuple[SessionAddress, Inbound]:
        """Split an inbound topic; raises InvalidTopic when any part is unusable."""
        head = self.prefix + "/"
        if not topic.startswith(head):
            raise InvalidTopic(f"topic outside prefix {self.prefix!r}")
        parts = topic[len(head) :].split("/")
        if len(parts) != 3:
            raise InvalidTopic("expected <user>/<session>/<kind> after the prefix")
        user, session, kind = parts
        try:
            inbound = Inbound(kind)
        except ValueError:
            raise InvalidTopic(f"unknown topic kind {kind[:40]!r}") from None
        return SessionAddress(user, session), inbound

    def _session_topic(self, address: SessionAddress, kind: str) -> str:
        return f"{self.prefix}/{address.user}/{address.session}/{kind}"

    def reply(self, address: SessionAddress) -> str:
        return self._session_topic(address, "reply")

    def stream(self, address: SessionAddress) -> str:
        return self._session_topic(address, "stream")

    def request(self, address: SessionAddress) -> str:
        return self._session_topic(address, "request")

    def control(self, address: SessionAddress) -> str:
        return self._session_topic(address, "control")

    def _worker_topic(self, worker_id: str, kind: str) -> str:
        if not TOPIC_PART.fullmatch(worker_id):
            raise InvalidTopic(f"worker id {worker_id!r} does not match {TOPIC_PART.pattern}")
        return f"{self.prefix}/{WORKER_NAMESPACE}/{worker_id}/{kind}"

    def status(self, worker_id: str) -> str:
        return self._worker_topic(worker_id, "status")

    def stats(self, worker_id: str) -> str:
        return self._worker_topic(worker_id, "stats")


def topic_matches(topic_filter: str, topic: str) -> bool:
    """MQTT filter matching (+ one level, # the rest) for the ResponseTopic allow list. As
    MQTT has it, a filter that starts with a wildcard does not match a topic that starts with
    ``$`` (the broker's own, ``$SYS/...``)."""
    filter_parts = topic_filter.split("/")
    topic_parts = topic.split("/")
    if topic.startswith("$") and filter_parts[0] in ("+", "#"):
        return False
    for index, part in enumerate(filter_parts):
        if part == "#":
            return True
        if index >= len(topic_parts):
            return False
        if part != "+" and part != topic_parts[index]:
            return False
    return len(filter_parts) == len(topic_parts)

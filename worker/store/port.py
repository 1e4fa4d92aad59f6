"""The session store's port: the HistoryStore contract, its typed faults, the stored state.

Every store keeps the contract; the faults are those of docs/reliability.md; SQLite and Redis
share the stored state's JSON encoding.

What is stored per session: the system prompt, the tools, the kept turns (as trimmed; each
turn's messages, tool rounds and pending calls included), the images the kept turns show (apart
from the state, which names them by hash: each written once, by the save that first refers to
it, in the same transaction, and deleted by the save that trims the last turn showing it;
``stored_images``), and the answers given to its requests by request key, so a redelivered
request is answered from here and never generates twice. ``reset`` deletes the conversation,
its images and the answers' text but keeps their keys (tombstones). Per request key, the number
of deliveries that did not end in an answer: a request that keeps killing the worker is
recognised (a poison request).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ..session import Progress, SessionHistory, StoredImage, ToolSpec, Turn, WorkerCallRecord


class StoreError(Exception):
    """A store operation failed. The request it served gets an error answer, never silence."""


class StoreUnavailable(StoreError):
    """The store cannot be used now (locked past the busy timeout, disk full, read-only, I/O
    error, Redis unreachable). It may recover by itself; the request can be sent again."""


class SessionUnreadable(StoreError):
    """One session's stored state cannot be parsed: that session alone is affected."""

    def __init__(self, session: str, detail: str) -> None:
        super().__init__(f"the stored state of session {session} cannot be read: {detail}")
        self.session = session


T = TypeVar("T")


def outcome(call: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """A store call's (result, error), for the thread that runs store calls for others
    (core/session_cache.py, SqliteStore.run_batch): the error is its caller's to handle, as
    from run_in_executor."""
    try:
        return call(), None
    except BaseException as exc:
        return None, exc


class HistoryStore(Protocol):
    # Shared by several workers (Redis): another worker may have changed a session since this
    # one loaded it, so it is loaded again for every request.
    shared: bool
    # Its calls may wait (for a lock, a network): they run on the store's thread
    # (core/session_cache.py). False only for the memory store, whose calls are dict operations:
    # made on the event loop, as a hop to another thread would cost more than the call.
    waits: bool

    def load(self, session: str) -> SessionHistory | None: ...

    def save(self, session: str, history: SessionHistory, key: str, payload: bytes | None) -> bytes | None:
        """The session's state and one answer (payload None: the state only), at once. None,
        or, from a shared store, the answer another worker stored for key first: then nothing
        was written, and that answer is the one to give."""

    def reset(self, session: str) -> None: ...

    def count_delivery(self, session: str, key: str) -> int:
        """Count one more delivery of a request; how many there have been."""

    def uncount_delivery(self, session: str, key: str) -> None:
        """A delivery that ended without an answer for a reason other than the request (a
        graceful stop): not held against it."""

    def expire(self, idle_seconds: float) -> list[str]:
        """Delete sessions idle for longer; their names."""

    def save_progress(self, session: str, key: str, progress: str) -> None:
        """A request's tool-loop progress (encode_progress), replacing the one before. ``save``
        of the request's answer deletes it, as does ``reset``."""

    def load_progress(self, session: str, key: str) -> str | None:
        """The request's stored progress, if any."""

    def close(self) -> None: ...

    # Optional (getattr): run_batch(calls) -> each call's (result, error), in order, the calls
    # committed together (SqliteStore.run_batch); the store's thread uses it where it is.


def encode_state(history: SessionHistory) -> str:
    """The session's state without its images' bytes: the turns refer to each image by hash
    and media type (ImageRef), and every store keeps the bytes apart, by (session, hash),
    written once in the save whose state first refers to them (stored_images)."""
    turns = [{"key": t.key, "messages": t.template_forms()} for t in history.turns]
    state: dict[str, Any] = {"systemPrompt": history.system_prompt, "turns": turns}
    if history.worker_tools:
        state["workerTools"] = history.worker_tools
    if history.tools:
        state["tools"] = [{k: v for k, v in vars(tool).items() if v is not None} for tool in history.tools]
    # Images were kept in the state until the stores kept them apart, and every commit wrote
    # them again: 8 images of 1 MB made an 11 MB state. Measured with bench/imagestore.py (8
    # images of 1 MB in the first turn, 9 text turns after it; 2-core CI machine, three runs):
    # a text turn's save took 300-340 ms on SQLite and 120-210 ms on Redis, a load 85-97 ms and
    # 104-137 ms. Apart, each image is written once, by the save of the turn that brings it
    # (105-150 ms on SQLite for those 8 MB), and a later turn's save writes a 2 KB state: 0.3 ms
    # on SQLite, 0.9-1.4 ms on Redis. A load still reads the images (the engine needs their
    # bytes): 5-7 ms on SQLite, 19-25 ms on Redis. A state with its images in it (an older
    # worker's) still reads (parse_state); its next save moves them out.
    return json.dumps(state, ensure_ascii=False)


def referenced_images(history: SessionHistory) -> set[str]:
    """The hashes of the images the kept turns refer to: what the store must keep for the
    session (an image no kept turn shows any more goes, in the save that trims its last turn)."""
    return {ref.sha256 for ref in history.image_refs()}


def stored_images(history: SessionHistory, stored: set[str]) -> tuple[dict[str, StoredImage], set[str]]:
    """What a save changes in the session's stored images, given the hashes ``stored`` now:
    the images to write (referenced, not stored yet, bytes at hand) and the hashes to delete
    (stored, no longer referenced)."""
    wanted = referenced_images(history)
    new = {sha: history.images[sha] for sha in wanted - stored if sha in history.images}
    return new, stored - wanted


def missing_images(history: SessionHistory) -> set[str]:
    """The hashes the kept turns refer to whose bytes the history does not hold: what a load
    reads from the store's images (all of them, but for a state that holds them itself)."""
    return referenced_images(history) - history.images.keys()


def _encoded_images(images: dict[str, StoredImage]) -> dict[str, Any]:
    return {
        sha: {"mediaType": image.media_type, "data": base64.b64encode(image.data).decode("ascii")}
        for sha, image in images.items()
    }


def _images(data: dict[str, Any]) -> dict[str, StoredImage]:
    return {
        str(sha): StoredImage(base64.b64decode(str(image["data"]), validate=True), str(image["mediaType"]))
        for sha, image in (data.get("images") or {}).items()
    }


def _turn(data: dict[str, Any]) -> Turn:
    if "messages" not in data:  # stored before tool calling: one user and one assistant message
        return Turn.plain(str(data["key"]), str(data["user"]), str(data["assistant"]))
    messages = data["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m["role"], str) for m in messages):
        raise TypeError("a turn's messages are not a list of messages")
    return Turn(str(data["key"]), messages)


def _tool(data: dict[str, Any]) -> ToolSpec:
    return ToolSpec(str(data["name"]), data.get("description"), data.get("parameters"), data.get("strict"))


def parse_session(session: str, state: str | bytes) -> tuple[str | None, list[Turn], list[ToolSpec], list[str]]:
    """The system prompt, turns, tools and worker tools (workerTools) of a stored state
    (parse_state: its images too)."""
    history = parse_state(session, state)
    return history.system_prompt, history.turns, history.tools, history.worker_tools


def parse_state(session: str, state: str | bytes) -> SessionHistory:
    """The system prompt, turns, tools and worker tools (workerTools) of a stored state, as a
    history without answers or images (the store adds the images it keeps apart);
    SessionUnreadable when it is damaged. A state stored before tool calling (turns of user
    and assistant text) reads as turns of two messages; one stored before images, as a
    session without images; one stored while images were kept in the state (``images``:
    hash -> media type and base64), with those images."""
    try:
        data = json.loads(state)
        images = _images(data)
        turns = [_turn(t) for t in data["turns"]]
        tools = [_tool(t) for t in data.get("tools") or []]
        worker_tools = [str(name) for name in data.get("workerTools") or []]
        system_prompt = data["systemPrompt"]
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise TypeError("systemPrompt is not a string")
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error) as exc:
        raise SessionUnreadable(session, f"{type(exc).__name__}: {str(exc)[:200]}") from None
    return SessionHistory(system_prompt, turns, tools, OrderedDict(), worker_tools, images)


def decode_history(session: str, state: str, answers: list[tuple[str, bytes | None]]) -> SessionHistory:
    history = parse_state(session, state)
    history.answered = OrderedDict(answers)
    return history


def encode_progress(progress: Progress) -> str:
    calls = {
        call_id: {"outcome": r.outcome, "durationMs": r.duration_ms, "round": r.round}
        for call_id, r in progress.calls.items()
    }
    data: dict[str, Any] = {"turnKey": progress.turn.key, "messages": progress.turn.template_forms(), "calls": calls}
    if progress.images:
        data["images"] = _encoded_images(progress.images)
    return json.dumps(data, ensure_ascii=False)


def decode_progress(session: str, text: str | bytes) -> Progress:
    try:
        data = json.loads(text)
        turn = _turn({"key": data["turnKey"], "messages": data["messages"]})
        calls = {
            str(call_id): WorkerCallRecord(str(r["outcome"]), float(r["durationMs"]), int(r["round"]))
            for call_id, r in data["calls"].items()
        }
        images = _images(data)
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error) as exc:
        raise SessionUnreadable(session, f"tool-loop progress: {type(exc).__name__}: {str(exc)[:200]}") from None
    return Progress(turn, calls, images)

"""SessionCache: the live sessions in memory, over any HistoryStore.

What a turn reads, and commits its answer to (store first, memory second).

The store's calls run on a thread of their own, never on the event loop: a store that waits
(SQLite for another connection's lock, up to 3 s; Redis across the network) holds the
requests that need it, not every session's stream. One thread, one store: its calls run one
at a time in the order they were made (SQLite's connection is used from that thread only,
and a session's writes are committed in the order its turns made them), while the event loop
goes on streaming. The calls made while the thread is busy run as one batch on its next turn,
and their results come back to the loop together: one hop between the threads for many calls;
SQLite commits such a batch as one transaction (SqliteStore.run_batch).
The intake makes as few as it can: the sessions of the requests waiting in the inbox are read
together (``aprefetch``), and a delivery is counted by its turn, not by its dispatch."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..session import Progress, SessionHistory
from ..store.port import HistoryStore, StoreError, decode_progress, encode_progress, outcome

T = TypeVar("T")


def _retrieve(done: asyncio.Future[Any]) -> None:
    """A store call whose caller was cancelled still runs to its end (see ``_call``): its
    error, if any, is the store's to log, not asyncio's ("exception was never retrieved")."""
    if not done.cancelled():
        done.exception()


def _settle(results: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    """On the event loop: hand a batch's results to their callers."""
    for done, value, error in results:
        if done.done():
            continue
        if error is None:
            done.set_result(value)
        else:
            done.set_exception(error)


class SessionCache:
    """The live sessions in memory, least recently used first, over the store: beyond
    capacity the oldest is dropped from memory (it stays in the store).

    The service awaits the ``a``-methods (``aget``, ``asave``, ``areset``, ...): they run the
    store's call on the store's thread, then update the memory (this cache) on the event loop,
    so the memory follows the store in the order the calls were made. The plain methods
    (``get``, ``save``, ``reset``, ``expire``) do the same on the caller's thread: for tests
    and tools outside the service, never for the service."""

    def __init__(self, store: HistoryStore, capacity: int) -> None:
        self.store = store
        self.capacity = capacity
        self._sessions: OrderedDict[str, SessionHistory] = OrderedDict()
        # Bytes of images each session stores, for the sessions this worker has read or
        # written since it started (kept after a session leaves memory): what a user namespace's
        # sessions hold together (vision.max_stored_bytes_per_user).
        self._image_bytes: dict[str, int] = {}
        # One worker thread: the calls run one at a time, in order. Its thread ends when the
        # cache is collected (concurrent.futures wakes an idle worker whose executor is gone).
        # Every store that may wait goes through it; the memory store's calls (dict
        # operations) are made on the event loop: a hop would cost more than the call
        # (``HistoryStore.waits``).
        # The calls waiting when the thread takes work run as one batch, their results handed
        # back to the loop at once: one thread hop for many calls. A hop per call cost the
        # intake 2-3 ms a request on a loaded 2-core machine (each waits for the other
        # thread's turn on the CPU and the GIL), ten times the work itself
        # (docs/performance.md, "Taking requests in").
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="session-store")
        self._queue: list[tuple[Callable[[], Any], asyncio.Future[Any]]] = []
        self._queue_lock = threading.Lock()  # held only to append or take the list: never waits
        self._draining = False  # a batch is scheduled on the thread and will take what is queued

    async def _call(self, call: Callable[..., T], *args: object) -> T:
        """``call(*args)`` on the store's thread (on the loop for a store that never waits).
        Once made, a call runs to its end even if the caller is cancelled (a stop): a commit is
        never cut off halfway, and the calls made after it (an uncounted delivery, say) find it
        done."""
        if not self.store.waits:
            return call(*args)  # the memory store: a dict, never waits
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        done.add_done_callback(_retrieve)
        with self._queue_lock:
            self._queue.append((functools.partial(call, *args), done))
            start = not self._draining
            self._draining = True
        if start:
            try:
                self._thread.submit(self._run_queued)
            except RuntimeError as exc:  # the executor was shut down (the interpreter exits)
                with self._queue_lock:
                    queued, self._queue, self._draining = self._queue, [], False
                _settle([(waiting, None, exc) for _, waiting in queued])
        return await asyncio.shield(done)

    def _run_queued(self) -> None:
        """On the store's thread: run what is queued, in order, batch by batch, until nothing is.
        Each result goes back to the loop its caller waits on: a call queued from a new loop
        while this drain still runs (tests run one asyncio.run after another with one cache)
        is answered on its own loop, not on the one that started the drain, which may be closed
        by then (its caller then waited forever: seen on a loaded machine)."""
        while True:
            with self._queue_lock:
                batch, self._queue = self._queue, []
                if not batch:
                    self._draining = False
                    return
            results: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any, BaseException | None]]] = {}
            for (_, done), (value, error) in zip(batch, self._outcomes([call for call, _ in batch]), strict=True):
                results.setdefault(done.get_loop(), []).append((done, value, error))
            for loop, settled in results.items():
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for these
                    loop.call_soon_threadsafe(_settle, settled)

    def _outcomes(self, calls: list[Callable[[], Any]]) -> list[tuple[Any, BaseException | None]]:
        """On the store's thread: each call's (result, error), in order; a store that can
        commit several calls at once (SqliteStore.run_batch) does, where there are several."""
        run_batch = getattr(self.store, "run_batch", None)
        if run_batch is not None and len(calls) > 1:
            outcomes: list[tuple[Any, BaseException | None]] = run_batch(calls)
            return outcomes
        return [outcome(call) for call in calls]

    def _cached(self, name: str) -> SessionHistory | None:
        """The session in memory, or None when it must be read from the store (not in memory,
        or a store that other workers share: read again for every request)."""
        history = self._sessions.get(name)
        return None if self.store.shared else history

    def _remember(self, name: str, history: SessionHistory) -> SessionHistory:
        stored = sum(len(image.data) for image in history.images.values())
        if stored:
            self._image_bytes[name] = stored
        else:
            self._image_bytes.pop(name, None)
        self._sessions[name] = history
        self._sessions.move_to_end(name)
        while len(self._sessions) > self.capacity:
            self._sessions.popitem(last=False)
        return history

    # -- reading --------------------------------------------------------------------------

    async def aget(self, name: str) -> SessionHistory:
        """A session's history: from memory, or from the store."""
        history = self._cached(name)
        if history is None:
            history = await self._call(self.store.load, name) or SessionHistory()
        return self._remember(name, history)

    async def aprefetch(self, names: Iterable[str]) -> None:
        """Read the sessions of ``names`` that are not in memory, in one call on the store's
        thread (a store shared with other workers is read for every request anyway: nothing).
        What cannot be read is left out: ``aget`` reads it again and answers for it. At most
        half the capacity, so that what is read stays in memory until it is used."""
        if self.store.shared:
            return
        wanted = [name for name in dict.fromkeys(names) if name not in self._sessions]
        wanted = wanted[: max(1, self.capacity // 2)]
        if not wanted:
            return
        for name, history in await self._call(self._load_many, wanted):
            if name not in self._sessions:  # else a commit or a read meanwhile put it there
                self._remember(name, history)

    def _load_many(self, names: list[str]) -> list[tuple[str, SessionHistory]]:
        loaded = []
        for name in names:
            with contextlib.suppress(StoreError):  # logged by the store (or unreadable: aget says so)
                loaded.append((name, self.store.load(name) or SessionHistory()))
        return loaded

    def get(self, name: str) -> SessionHistory:
        """``aget`` on the caller's thread."""
        history = self._cached(name)
        if history is None:
            history = self.store.load(name) or SessionHistory()
        return self._remember(name, history)

    # -- committing -----------------------------------------------------------------------

    async def asave(self, name: str, history: SessionHistory, key: str, payload: bytes | None) -> bytes | None:
        """Commit a session's new state with the answer to key: in the store (one
        transaction) first, then in memory, so a store that fails (StoreError) leaves both as
        they were. ``history`` is the draft the turn ran on (SessionHistory.draft); nothing
        else changes it until this returns. None, or the answer another worker stored for key
        first (HistoryStore.save)."""
        first = await self._call(self.store.save, name, history, key, payload)
        return self._saved(name, history, key, payload, first)

    def save(self, name: str, history: SessionHistory, key: str, payload: bytes | None) -> bytes | None:
        """``asave`` on the caller's thread."""
        first = self.store.save(name, history, key, payload)
        return self._saved(name, history, key, payload, first)

    def _saved(
        self, name: str, history: SessionHistory, key: str, payload: bytes | None, first: bytes | None
    ) -> bytes | None:
        if payload is not None:
            history.remember_answer(key, first if first is not None else payload)
        self._remember(name, history)
        return first

    async def areset(self, name: str) -> None:
        """Forget the conversation, in the store first. The stored state is not read: a session
        whose row is unreadable can be reset."""
        await self._call(self.store.reset, name)
        self._was_reset(name)

    def reset(self, name: str) -> None:
        """``areset`` on the caller's thread."""
        self.store.reset(name)
        self._was_reset(name)

    def image_bytes(self, user: str, but: str | None = None) -> int:
        """The bytes of images the sessions of a user namespace store (those known to this
        worker), but session ``but``."""
        prefix = f"{user}/"
        return sum(n for name, n in self._image_bytes.items() if name.startswith(prefix) and name != but)

    def _was_reset(self, name: str) -> None:
        self._image_bytes.pop(name, None)
        cached = self._sessions.get(name)
        if cached is not None:
            cached.reset()

    async def aexpire(self, idle_seconds: float) -> int:
        """Delete the sessions idle for longer, from the store and from memory; how many."""
        return self._expired(await self._call(self.store.expire, idle_seconds))

    def expire(self, idle_seconds: float) -> int:
        """``aexpire`` on the caller's thread."""
        return self._expired(self.store.expire(idle_seconds))

    def _expired(self, names: list[str]) -> int:
        for name in names:
            self._sessions.pop(name, None)
            self._image_bytes.pop(name, None)
        return len(names)

    # -- delivery counts (poison requests) ---------------------------------------------------

    async def acount_delivery(self, name: str, key: str) -> int:
        return await self._call(self.store.count_delivery, name, key)

    async def auncount_delivery(self, name: str, key: str) -> None:
        await self._call(self.store.uncount_delivery, name, key)

    # -- tool-loop progress (never actuate twice: docs/reliability.md) ----------------------

    async def asave_progress(self, name: str, key: str, progress: Progress) -> None:
        """Store a request's tool-loop progress; StoreError when it cannot be stored (then no
        call may be sent)."""
        await self._call(self.store.save_progress, name, key, encode_progress(progress))

    async def aload_progress(self, name: str, key: str) -> Progress | None:
        text = await self._call(self.store.load_progress, name, key)
        return None if text is None else decode_progress(name, text)

    def __len__(self) -> int:
        return len(self._sessions)

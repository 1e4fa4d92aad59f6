"""The service: MQTT messages in, engine generations, replies and stats out.

One asyncio loop owns all state. Messages are dispatched one at a time, in the order they
arrived; each accepted request becomes a task that waits for its session's lock (asyncio
locks are FIFO, and the tasks ask for it in dispatch order, so a session's turns run in
arrival order) and then streams from the engine; tasks of different sessions run at once,
and the engine batches them continuously. The session store's calls run on a thread of their
own (SessionCache): a dispatch or a turn that waits for the store holds itself and the
messages behind it, never the event loop and its streams.

The delivery invariant (docs/reliability.md) lives here, in ``_acknowledge``, the one place
that acknowledges: a message is acknowledged after its answer (reply or error) was taken by
the broker, or when it is one of the documented messages that get no answer (an invalid
topic, a retained request, a cancel). A turn works on a draft of its session, and only the
answered turn is committed (one store transaction): a refused or failed request leaves the
session as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from loguru import logger

from ..config.models import WorkerConfig
from ..engine.port import Engine, EngineDead, ToolSupport
from ..protocol.images import ImageLimits, may_carry_images
from ..protocol.messages import (
    ChatRequest,
    ControlReply,
    ErrorBody,
    ErrorCode,
    ErrorReply,
    RequestError,
    best_effort_request_id,
    fresh_key,
    log_ref,
    log_text,
    parse_chat_request,
    parse_control,
    request_key,
)
from ..protocol.packets import fit_answer
from ..protocol.topics import Inbound, InvalidTopic, SessionAddress, Topics, tool_responses_topic, topic_matches
from ..session import SessionHistory
from ..store.port import HistoryStore, SessionUnreadable, StoreError, StoreUnavailable
from ..tools.port import Toolbox
from ..transport.port import InboundMessage, PublishNotSent, PublishRefused, Transport, log_publish_failure
from ..vision.topics import VisionTopics
from .history import HistoryLimits, PromptRenderer
from .pending import PendingTurn, ReplyTarget, SessionRuntime
from .ratelimit import RateLimiter
from .session_cache import SessionCache
from .stats import StatsCollector
from .turns import ImageDecoder, TurnRunner, keep_bytes

DISPATCH_TRIES = 60
# At most this many messages waiting in the inbox are taken at once, their sessions read in one
# store call.
PREFETCH = 256
# Messages dispatched before the loop lets the turns they started take a step. Without a pause,
# the 256 of a prefetch all rendered their prompts before the first of them could go on to the
# engine: the loop runs what is ready in order, and a turn whose segments came back from the
# encoding thread was behind all 256. With the tokenizer's bounded batches (engine/tokenizer.py),
# 1,000 first turns at once (bench.intake --to-engine, 2 cores) reached the engine from 0.07-0.08 s
# on (median 0.62-0.75 s) instead of all at the end (first 0.99-1.04 s, median 1.03-1.07 s).
DISPATCH_SLICE = 16


def store_refusal(exc: StoreError) -> RequestError:
    """The answer to a request whose session store failed (StoreError)."""
    if isinstance(exc, SessionUnreadable):
        return RequestError(
            ErrorCode.SESSION_UNREADABLE,
            "this session's stored history cannot be read; reset the session (action reset) to start it again",
        )
    return RequestError(ErrorCode.STORE_UNAVAILABLE, "the session store is unavailable; send the request again later")


class InFlight:
    """The requests a Service runs (their tasks) and how many more it takes. Made before the
    Service and handed to it, so that what feeds the service and is built before it (the
    Redis intake: the service reads from it) can read the free room at construction."""

    def __init__(self, limit: int) -> None:
        self.limit = limit  # limits.max_pending_requests
        self.tasks: set[asyncio.Task[None]] = set()
        # The message being dispatched (0 or 1): out of the inbox, waiting for the session
        # store, not yet a task or an answer.
        self.dispatching = 0

    def room(self) -> int:
        return self.limit - len(self.tasks) - self.dispatching


class Service:
    def __init__(
        self,
        config: WorkerConfig,
        engine: Engine,
        renderer: PromptRenderer,
        transport: Transport,
        stop_requested: Callable[[int], None],
        store: HistoryStore,
        in_flight: InFlight | None = None,
        tools: ToolSupport | None = None,
        *,
        toolbox: Toolbox | None = None,
        vision_topics: VisionTopics | None = None,
        decode_image: ImageDecoder = keep_bytes,
    ) -> None:
        self.config = config
        # A request with images is parsed within the [vision] limits where the model takes
        # images; elsewhere it is refused with invalid_request, naming the model.
        self.image_limits = ImageLimits.of(config.vision) if engine.info.vision is not None else None
        self.vision_topics = vision_topics
        self.engine = engine
        self.renderer = renderer
        self.transport = transport
        self.topics = Topics(config.mqtt.topic_prefix)
        self.worker_id = config.effective_worker_id
        self._tool_responses = tool_responses_topic(config.mqtt.topic_prefix, self.worker_id)
        self.sessions = SessionCache(store, config.history.max_sessions)
        self.stats = StatsCollector(self.worker_id)
        self._runtime: dict[str, SessionRuntime] = {}
        self.rate_limiter = RateLimiter(config.limits.max_requests_per_user_per_minute)
        self._tasks: set[asyncio.Task[None]] = set()
        self.in_flight = in_flight if in_flight is not None else InFlight(config.limits.max_pending_requests)
        self._stop_requested = stop_requested
        self._draining = False
        # Held while a message is dispatched: the drain waits for the one whose store calls
        # are under way, so that a turn it starts is among those the drain waits for.
        self._dispatching = asyncio.Lock()
        self._failures: dict[str, int] = {}  # intake entry -> failed dispatches
        self.turns = TurnRunner(
            engine=engine,
            renderer=renderer,
            generation=config.generation,
            limits=HistoryLimits(config.history.max_history_turns, config.history.max_history_tokens),
            default_system_prompt=config.history.system_prompt,
            topics=self.topics,
            publisher=transport,
            stats=self.stats,
            engine_died=stop_requested,
            tool_support=tools,
            max_tool_result_bytes=config.limits.max_tool_result_bytes,
            toolbox=toolbox,
            tool_limits=config.tools,
            vision_topics=vision_topics,
            vision=config.vision,
            user_image_bytes=self.sessions.image_bytes,
            decode_image=decode_image,
            journal=self.sessions,
            # A share group's members answer each other's redeliveries: the group, not the member.
            call_scope=f"{config.mqtt.topic_prefix}/{config.mqtt.share_group or self.worker_id}",
        )

    @property
    def pending(self) -> int:
        return len(self.in_flight.tasks)

    # -- main loops ---------------------------------------------------------------------

    async def consume(self) -> None:
        inbox = self.transport.inbox
        while True:
            batch = [await inbox.get()]
            if not self.sessions.store.shared:
                # The messages already waiting too: the sessions they need that are not in
                # memory are read in one call on the store's thread, not one round trip per
                # message (docs/performance.md, "Taking requests in"). A shared store is read
                # for every request anyway, message by message.
                while len(batch) < PREFETCH and not inbox.empty():
                    batch.append(inbox.get_nowait())
            done = 0  # messages of the batch dispatched, or being dispatched
            try:
                self.in_flight.dispatching = len(batch)
                if len(batch) > 1:
                    await self._prefetch(batch)
                for message in batch:
                    done += 1
                    await self._dispatch_one(message, left=len(batch) - done)
                    if done % DISPATCH_SLICE == 0:
                        await asyncio.sleep(0)  # the turns just started take their next step
            except asyncio.CancelledError:
                self._put_back(batch[done:])
                raise
            finally:
                self.in_flight.dispatching = 0

    async def _dispatch_one(self, message: InboundMessage, *, left: int) -> None:
        """Dispatch one message; ``left``: the messages taken with it still to come, counted
        as dispatching (the Redis intake reads no more than the room left)."""
        async with self._dispatching:
            if self._draining:
                # Left unacknowledged: the broker delivers it again after the restart.
                logger.info("Stopping: a message left unacknowledged for the next start")
                return
            try:
                await self.dispatch(message)
            except StoreUnavailable as exc:  # from the intake only: its entry is tried again
                self._after_failure(message, exc)
            except Exception as exc:  # one bad message must not stop the worker
                logger.exception("Unexpected error handling a message")
                self._after_failure(message, exc)
            else:
                if self._failures and message.entry is not None:
                    self._failures.pop(message.entry, None)
            finally:
                self.in_flight.dispatching = left

    async def _prefetch(self, batch: list[InboundMessage]) -> None:
        """Read the sessions of the batch's requests that are not in memory, in one store call."""
        names = []
        for message in batch:
            try:
                address, kind = self.topics.parse(message.topic)
            except InvalidTopic:
                continue
            if kind is Inbound.REQUEST and not message.retain:
                names.append(str(address))
        await self.sessions.aprefetch(names)

    def _put_back(self, messages: list[InboundMessage]) -> None:
        """Messages taken from the inbox and not dispatched (the consumer was cancelled) go
        back to its front, in their order: as if never taken."""
        if not messages:
            return
        inbox = self.transport.inbox
        rest = []
        while not inbox.empty():
            rest.append(inbox.get_nowait())
        for message in [*messages, *rest]:
            inbox.put_nowait(message)

    def _after_failure(self, message: InboundMessage, exc: Exception) -> None:
        """A message whose handling raised unexpectedly. From the Redis intake, with tries
        left, it is handed in again a second later, so an unreachable store for a while (up to
        DISPATCH_TRIES s) loses no request. Otherwise it is answered with internal_error; if
        not even that can be built, it stays unacknowledged (the broker delivers it again
        after a reconnect): never acknowledged in silence."""
        if message.entry is not None:
            tries = self._failures.get(message.entry, 0) + 1
            if tries < DISPATCH_TRIES:
                self._failures[message.entry] = tries
                asyncio.get_running_loop().call_later(1.0, self.transport.inbox.put_nowait, message)
                return
            self._failures.pop(message.entry, None)
        try:
            address, _ = self.topics.parse(message.topic)
            request_id = best_effort_request_id(message.payload, self._readable_bytes(message.payload))
            if isinstance(exc, StoreError):
                error = store_refusal(exc)
            else:
                error = RequestError(ErrorCode.INTERNAL_ERROR, "internal error; sending the request again may work")
            self._answer_error(message, address, self._reply_target(message, address), request_id, error)
        except Exception:
            logger.exception("Cannot answer a message that failed: it stays unacknowledged")

    async def publish_stats_forever(self) -> None:
        interval = self.config.stats.interval
        if interval <= 0:
            return
        while True:
            await asyncio.sleep(interval)
            self.publish_stats()

    async def expire_sessions_forever(self) -> None:
        """Delete sessions idle for longer than session_ttl, checking every tenth of it (at
        most every 10 minutes)."""
        ttl = self.config.history.session_ttl
        if ttl <= 0:
            return
        while True:
            try:
                expired = await self.sessions.aexpire(ttl)
            except StoreError:
                pass  # logged by the store; tried again at the next check
            else:
                if expired:
                    logger.info("Expired {} session(s) idle for over {:.0f}s", expired, ttl)
            await asyncio.sleep(min(ttl / 10, 600))

    def publish_stats(self) -> None:
        report = self.stats.report(self.engine.take_stats(), sessions=len(self.sessions), pending=self.pending)
        logger.info(report.log_line())
        done = self.transport.publish(self.topics.stats(self.worker_id), report.to_json(), qos=1, retain=True)
        log_publish_failure(done, "the stats")

    async def drain(self, timeout: float) -> None:
        """Let running generations finish (up to timeout), then abort the rest unanswered:
        they stay unacknowledged and the broker redelivers them after a restart."""
        # Not an unsubscribe: that would empty the broker's persistent session, and requests
        # sent while the worker is down would be lost instead of queued for its restart.
        self._draining = True
        async with self._dispatching:
            pass  # the message being dispatched has its turn (a task waited for below), or its answer
        if self._tasks:
            logger.info("Draining {} pending request(s) for up to {:.0f}s", len(self._tasks), timeout)
            _, still_running = await asyncio.wait(set(self._tasks), timeout=timeout)
            for task in still_running:
                task.cancel()
            if still_running:
                logger.warning("Stopped {} unfinished request(s); they are left unacknowledged", len(still_running))
                await asyncio.wait(still_running, timeout=5)

    # -- dispatch -----------------------------------------------------------------------

    async def dispatch(self, message: InboundMessage) -> None:
        """Handle one message: answer it, or start its turn. It waits only for the session
        store, where the session is not in memory (or the store is shared) and for an intake
        entry's delivery count, on the store's thread; the next message is
        dispatched once this one is, so that requests take their places in their sessions'
        queues, and in the pending count, in the order they arrived."""
        try:
            address, kind = self.topics.parse(message.topic)
        except InvalidTopic as exc:
            if self._watched_before_watching(message):
                self._acknowledge([message])
                return
            # Named escaped and cut (log_text): the sender chose it, but it cannot forge a line.
            logger.warning("Ignoring a message on an invalid topic {}: {}", log_text(message.topic, 128), exc)
            self.stats.record_invalid_topic()
            self._acknowledge([message])
            return
        if message.retain:
            # A retained request would be replayed to every worker that subscribes: never run it.
            logger.warning("Ignoring a retained message on {}'s {} topic", address, kind.value)
            self._acknowledge([message])
            return
        if kind is Inbound.CONTROL:
            self._dispatch_control(message, address)
        else:
            await self._dispatch_request(message, address)

    def _watched_before_watching(self, message: InboundMessage) -> bool:
        """A message that is no request, on a topic the worker's tools or vision topics watch,
        come before they started watching: the broker session of a restart delivers what it
        kept (a device's late answer to the killed run's call) at the connect, before the tools
        subscribe. No call of this run waits for such an answer, and a watched image topic's
        retained image comes again with the subscription: dropped, not taken for an invalid
        request (seen beside a CPU hog: "Ignoring a message on an invalid topic
        '<prefix>/_tools/<id>/responses'" 2 ms before the tools' SUBSCRIBE)."""
        topic = message.topic
        if topic == self._tool_responses:
            logger.debug("Dropping a device answer on {} that no call waits for (before the tools started)", topic)
            return True
        if self.vision_topics is not None and any(topic_matches(f, topic) for f in self.vision_topics.filters):
            logger.debug("Dropping an image on {} that came before its topic was watched", log_text(topic, 128))
            return True
        return False

    def _runtime_for(self, address: SessionAddress) -> SessionRuntime:
        return self._runtime.setdefault(str(address), SessionRuntime())

    def _spawn(self, coro: Coroutine[Any, Any, None], *, request: bool = False) -> None:
        """Run coro as a task the drain waits for; a request's task also counts as pending."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        if request:
            self.in_flight.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self.in_flight.tasks.discard(task)
        if not task.cancelled():
            exc = task.exception()
            if exc is not None and not isinstance(exc, EngineDead):
                logger.opt(exception=exc).error("Request task failed")

    async def _dispatch_request(self, message: InboundMessage, address: SessionAddress) -> None:
        runtime = self._runtime_for(address)
        # Counted as waiting while the store is read: the session's runtime (its queue and
        # lock) stays the one every message of the session finds.
        runtime.waiting += 1
        queued = False
        try:
            queued = await self._take_request(message, address, runtime)
        finally:
            if not queued:
                runtime.waiting -= 1
                self._forget_if_idle(address, runtime)  # else every refused session would stay

    async def _take_request(self, message: InboundMessage, address: SessionAddress, runtime: SessionRuntime) -> bool:
        """Answer the request (from the store, or with a refusal), join it to the copy in
        progress, or queue its turn: True when its turn was queued."""
        payload = message.payload
        if self._off_loop(payload):
            # An image request's payload (megabytes) is read on a thread: the loop keeps streaming.
            request_id = await asyncio.to_thread(best_effort_request_id, payload, self._readable_bytes(payload))
        else:
            request_id = best_effort_request_id(payload, self._readable_bytes(payload))
        target = self._reply_target(message, address)
        name = str(address)
        key = request_key(message.topic, message.payload, request_id, message.mid if message.qos else 0)
        try:
            history = await self.sessions.aget(name)
        except SessionUnreadable:
            # Its turn reads it again, in order after a reset queued before it (which mends
            # it), and answers session_unreadable if it is still damaged then.
            history = SessionHistory()
        except StoreError as exc:
            if message.entry is not None and isinstance(exc, StoreUnavailable):
                raise  # the intake's entry is tried again for a while (_after_failure)
            self._answer_error(message, address, target, request_id or key, store_refusal(exc))
            return False
        if request_id is None and not message.dup and (key in history.answered or key in runtime.messages):
            # Not a redelivery (no DUP flag), yet its hash key is taken: the same text again
            # with a packet id the broker used before (ids wrap, or a broker session was lost).
            key = fresh_key(key)
        if key in history.answered:
            stored = history.answered[key]
            if stored is None:  # answered before a reset deleted the reply: never generated again
                duplicate = RequestError(
                    ErrorCode.DUPLICATE_REQUEST,
                    "this request was answered before the session was reset, and its reply was deleted; "
                    "to ask again, send it with a new requestId",
                )
                self._answer_error(message, address, target, key, duplicate)
            else:
                logger.info("Request {} of {} already answered: publishing the stored reply", log_ref(key), address)
                self._answer([message], target, stored)
            return False
        if key in runtime.messages:
            logger.info("Request {} of {} is a redelivery of one in progress", log_ref(key), address)
            runtime.messages[key].append(message)
            return False
        try:
            self._check_rate(address)
            request = await self._parse(payload, address)
            self._admit(request, runtime)
            # The delivery is counted by its turn, when it starts (the count only has to be on
            # record before the generation): a dispatch then makes no store call for a
            # session in memory, where it waited for a round trip to the store's thread for
            # each request (measured in docs/performance.md, "Taking requests in"). An
            # intake entry is counted here: a store away makes its dispatch fail and be tried
            # again (_after_failure), which its turn could not do.
            deliveries = await self._count_delivery(name, key) if message.entry is not None else None
        except (RequestError, StoreError) as exc:
            if message.entry is not None and isinstance(exc, StoreUnavailable):
                raise
            refusal = store_refusal(exc) if isinstance(exc, StoreError) else exc
            self._answer_error(message, address, target, key, refusal)
            return False
        runtime.messages[key] = [message]
        deadline = self._deadline(message)
        turn = PendingTurn(message, address, target, key, request, runtime, deadline)
        self._spawn(self._run_turn(turn, deliveries), request=True)
        return True

    def _readable_bytes(self, payload: bytes) -> int:
        """The largest payload of this kind whose requestId is read: an image request's limit
        for a payload that may carry images (its error then names its requestId, on a model
        without vision too), else max_payload_bytes."""
        limit = self.config.limits.max_payload_bytes
        if len(payload) > limit and may_carry_images(payload):
            return max(limit, self.config.vision.max_request_bytes)
        return limit

    def _off_loop(self, payload: bytes) -> bool:
        """Whether the payload is read on a thread: one over max_payload_bytes that is read at
        all (an image request: up to [vision] max_request_bytes, tens of ms of JSON and base64)."""
        return self.config.limits.max_payload_bytes < len(payload) <= self._readable_bytes(payload)

    async def _parse(self, payload: bytes, address: SessionAddress) -> ChatRequest:
        limits, model = self.image_limits, self.engine.info.model
        max_bytes = self.config.limits.max_payload_bytes
        # The request's JSON Schemas are checked in its turn, on a thread (TurnRunner.run).
        read = functools.partial(parse_chat_request, model=model, check_schemas=False)
        if self._off_loop(payload):
            return await asyncio.to_thread(read, payload, address.session, max_bytes, limits)
        return read(payload, address.session, max_bytes, limits)

    def _poison(self, turn: PendingTurn, deliveries: int) -> RequestError | None:
        """The final error of a request delivered again and again without an answer: it
        crashed the worker (or its engine) each time. It ends the loop, stored as its answer in
        the session's turn (its lock): with the session's own commits in order."""
        if deliveries <= self.config.limits.max_deliveries:
            return None
        logger.error(
            "Request {} of {} is poison ({} deliveries without an answer)",
            log_ref(turn.key),
            turn.address,
            deliveries - 1,
        )
        return RequestError(
            ErrorCode.ENGINE_ERROR,
            f"the request was tried {deliveries - 1} times and never completed; it is not tried again",
        )

    async def _count_delivery(self, name: str, key: str) -> int:
        try:
            return await self.sessions.acount_delivery(name, key)
        except asyncio.CancelledError:
            # Stopped while counting (the count runs to its end on the store's thread): a
            # stop is not the request's fault.
            await self._uncount_delivery(name, key)
            raise

    def _deadline(self, message: InboundMessage) -> float | None:
        """When the request's turn must have started: its MQTT Message Expiry, and
        request_deadline after it arrived, whichever is first."""
        limit = self.config.limits.request_deadline
        ends = [message.expires_at, message.received_at + limit if limit > 0 else None]
        return min((end for end in ends if end is not None), default=None)

    def _check_rate(self, address: SessionAddress) -> None:
        """Per user namespace, not per session: new sessions do not get around it."""
        if not self.rate_limiter.allow(address.user):
            raise RequestError(
                ErrorCode.RATE_LIMITED,
                f"more than {self.rate_limiter.per_minute} requests a minute from {address.user!r}; "
                f"retry in {self.rate_limiter.retry_after(address.user):.1f} s",
            )

    def _admit(self, request: ChatRequest, runtime: SessionRuntime) -> None:
        limits, generation = self.config.limits, self.config.generation
        if request.max_tokens is not None and request.max_tokens > generation.max_tokens_limit:
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                f"maxTokens {request.max_tokens} exceeds the limit of {generation.max_tokens_limit}",
            )
        if self.pending >= limits.max_pending_requests:
            raise RequestError(ErrorCode.BUSY, f"{self.pending} requests pending; try again later")
        waiting = len(runtime.messages) - (1 if runtime.running or runtime.lock.locked() else 0)
        if len(runtime.messages) > limits.max_queued_per_session:  # one running plus the queue
            raise RequestError(ErrorCode.BUSY, f"{waiting} requests of this session are queued")
        if request.message is None:
            return  # tool results: each is capped in bytes (max_tool_result_bytes) by its turn
        # A token covers at least one byte of the text (SentencePiece adds one for the space
        # it prefixes): a message with fewer bytes than the limit is not encoded here at all.
        if len(request.message.encode()) + 1 <= limits.max_message_tokens:
            return
        message_tokens = self.renderer.count_text(request.message)
        if message_tokens > limits.max_message_tokens:
            raise RequestError(
                ErrorCode.TOO_LONG, f"message is {message_tokens} tokens; the limit is {limits.max_message_tokens}"
            )

    def _dispatch_control(self, message: InboundMessage, address: SessionAddress) -> None:
        target = self._reply_target(message, address)
        try:
            control = parse_control(message.payload, self.config.limits.max_payload_bytes)
        except RequestError as exc:
            request_id = best_effort_request_id(message.payload, self.config.limits.max_payload_bytes)
            self._answer_error(message, address, target, request_id, exc)
            return
        runtime = self._runtime_for(address)
        if control.action == "cancel":
            if control.request_id is None:
                missing = RequestError(ErrorCode.INVALID_REQUEST, "cancel needs the requestId of the request to cancel")
                self._answer_error(message, address, target, None, missing)
            else:
                # Answered by the cancelled request's reply (finishReason cancelled); a cancel of
                # nothing in flight (answered already, or unknown) has nothing to answer.
                self._cancel(address, runtime, control.request_id)
                self._acknowledge([message])
        elif control.action == "reset":
            runtime.waiting += 1
            self._spawn(self._reset(message, address, target, runtime, control.request_id), request=True)
        else:
            unsupported = RequestError(ErrorCode.UNSUPPORTED_ACTION, "unknown action; use reset or cancel")
            self._answer_error(message, address, target, control.request_id, unsupported)
        self._forget_if_idle(address, runtime)

    def _cancel(self, address: SessionAddress, runtime: SessionRuntime, key: str) -> None:
        if key in runtime.running:
            logger.info("Cancelling running request {} of {}", log_ref(key), address)
            self._spawn(self.engine.abort(runtime.running[key]))
        elif key in runtime.messages:
            # Queued, or between its generations (its worker calls are out): it stops at the
            # next generation, which is not made.
            logger.info(
                "Cancelling queued request {} of {} (waiting for its turn or for its worker calls)",
                log_ref(key),
                address,
            )
            runtime.cancelled.add(key)
        else:
            logger.info("Cancel for {} of {}: nothing in flight", log_ref(key), address)

    async def _reset(
        self,
        message: InboundMessage,
        address: SessionAddress,
        target: ReplyTarget,
        runtime: SessionRuntime,
        request_id: str | None,
    ) -> None:
        """A reset runs in order with the session's requests: after those that arrived before
        it (they are answered with the old history), before those that arrive after it."""
        try:
            async with runtime.lock:
                runtime.waiting -= 1
                try:
                    await self.sessions.areset(str(address))
                except StoreError as exc:
                    payload = self._error_payload(address, request_id, store_refusal(exc))
                else:
                    logger.info("Session {} reset", address)
                    payload = ControlReply(session_id=address.session, action="reset").to_json()
            await self._confirmed_answer([message], target, payload)
        finally:
            self._forget_if_idle(address, runtime)

    # -- one turn -----------------------------------------------------------------------

    async def _run_turn(self, turn: PendingTurn, deliveries: int | None = None) -> None:
        """Count the delivery (unless ``deliveries`` says it was counted at dispatch), generate,
        commit the answered turn with its answer (one transaction), publish the answer, and
        acknowledge the request only once the broker has the answer. A request delivered too
        often gets a final error instead, stored as its answer."""
        message, address, target, key, runtime = turn.message, turn.address, turn.target, turn.key, turn.runtime
        name = str(address)
        settled = False  # the delivery has its outcome: an answer committed, or a refusal
        counted = deliveries is not None
        try:
            async with runtime.lock:
                runtime.waiting -= 1
                if deliveries is None:
                    try:
                        deliveries = await self._count_delivery(name, key)
                        counted = True
                    except StoreError as exc:
                        deliveries = 0
                        payload = self._error_payload(address, key, store_refusal(exc))
                        settled = True
                if not settled:
                    poison = self._poison(turn, deliveries)
                    if poison is None:
                        payload = await self._answer_turn(turn, name)
                    else:
                        payload = await self._final_error(turn, name, poison)
                    settled = True
            await self._confirmed_answer(runtime.messages.get(key, [message]), target, payload)
        except asyncio.CancelledError:
            # Shutting down: the work was interrupted and has no answer yet (or its answer is
            # stored but not confirmed). Left unacknowledged, the broker redelivers it after
            # the restart; a stop is not the request's fault, so it does not count as a try.
            if counted and not settled:
                await self._uncount_delivery(name, key)
            raise
        except EngineDead:
            raise  # left unacknowledged and counted: the request may be what killed the engine
        except Exception:  # a bug of ours: answer rather than leave the client waiting
            logger.exception("Unexpected error on request {} of {}", log_ref(key), address)
            error = RequestError(ErrorCode.INTERNAL_ERROR, "internal error; sending the request again may work")
            await self._confirmed_answer(
                runtime.messages.get(key, [message]), target, self._error_payload(address, key, error)
            )
        finally:
            runtime.messages.pop(key, None)
            runtime.cancelled.discard(key)
            self._forget_if_idle(address, runtime)

    async def _answer_turn(self, turn: PendingTurn, name: str) -> bytes:
        """The turn's answer: its reply, with the session's new state committed, or an error
        with the session left as it was."""
        address, key = turn.address, turn.key
        try:
            history = await self.sessions.aget(name)
            answer = await self.turns.run(turn, history.draft())
            if answer.state is None:  # cancelled: no turn, nothing to commit
                await self._uncount_delivery(name, key)
                return answer.payload
            # Only the images a kept turn shows are stored: a trimmed turn's go with it.
            answer.state.images = answer.state.kept_images()
            first = await self.sessions.asave(name, answer.state, key, answer.payload)
        except RequestError as exc:
            await self._uncount_delivery(name, key)  # answered: not a try that failed
            return self._error_payload(address, key, exc)
        except StoreError as exc:
            # Nothing committed, so nothing is published as answered: the turn would be
            # missing from the history the next turn sees.
            return self._error_payload(address, key, store_refusal(exc))
        if first is not None:  # a worker taken for dead answered it too, first
            logger.warning("Request {} of {} was answered by another worker first", log_ref(key), address)
            return first
        return answer.payload

    async def _final_error(self, turn: PendingTurn, name: str, error: RequestError) -> bytes:
        """The final error of a poison request, stored as its answer: a redelivery gets it
        again. A store error is logged by the store: answered all the same, and a redelivery
        decides again."""
        payload = self._error_payload(turn.address, turn.key, error)
        try:
            history = await self.sessions.aget(name)
            first = await self.sessions.asave(name, history.draft(), turn.key, payload)
        except StoreError:
            return payload
        return first if first is not None else payload

    async def _uncount_delivery(self, name: str, key: str) -> None:
        # A store error is logged by the store; the count only matters if the request comes back.
        with contextlib.suppress(StoreError):
            await self.sessions.auncount_delivery(name, key)

    # -- replies ------------------------------------------------------------------------

    def _reply_target(self, message: InboundMessage, address: SessionAddress) -> ReplyTarget:
        own = self.topics.reply(address)
        wanted = message.response_topic
        if wanted and wanted != own:
            allowed = not any(c in wanted for c in "+#") and any(
                topic_matches(pattern, wanted) for pattern in self.config.mqtt.allowed_response_topics
            )
            if not allowed:
                logger.warning("A ResponseTopic of {} is not allowed; replying on the session's own topic", address)
                logger.debug("ResponseTopic {!r} not allowed", wanted[:300])
                wanted = None
        return ReplyTarget(wanted or own, message.correlation_data)

    def _publish(self, target: ReplyTarget, payload: bytes) -> asyncio.Future[None]:
        limit = self.transport.payload_limit(target.topic, qos=1, correlation_data=target.correlation_data)
        fitted = fit_answer(payload, limit)
        if fitted is None:
            nothing: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            nothing.set_exception(PublishRefused("not even an error fits the broker's maximum packet size"))
            return nothing
        if fitted is not payload:
            logger.warning("An answer was cut to the broker's maximum packet size")
        return self.transport.publish(target.topic, fitted, qos=1, correlation_data=target.correlation_data)

    async def _confirmed_answer(self, messages: list[InboundMessage], target: ReplyTarget, payload: bytes) -> None:
        """Publish an answer; acknowledge the request (and its redelivered copies) once the
        broker has taken it. Until then a crash leaves the request to be delivered again, and
        it is answered from the store. An answer the broker refuses is final (it would be
        refused again): the request is acknowledged, with an error in the log. One not sent
        leaves the request unacknowledged, for the broker to deliver again."""
        try:
            await self._publish(target, payload)
        except PublishRefused as exc:
            logger.error("An answer was refused ({}); its request is acknowledged: it would be refused again", exc)
        except PublishNotSent as exc:
            logger.warning("An answer was not sent ({}); its request is left to be delivered again", exc)
            return
        self._acknowledge(messages)

    def _acknowledge(self, messages: Iterable[InboundMessage]) -> None:
        """The one place that acknowledges a message (docs/reliability.md): after its answer
        was taken by the broker, or for a message that gets no answer by design (an invalid
        topic, a retained request, a cancel)."""
        for message in messages:
            self.transport.ack(message)

    def _answer(self, messages: list[InboundMessage], target: ReplyTarget, payload: bytes) -> None:
        self._spawn(self._confirmed_answer(messages, target, payload))

    def _error_payload(self, address: SessionAddress, key: str | None, exc: RequestError) -> bytes:
        # The message can quote the client's text (a field's name, an action): DEBUG only.
        logger.info("Request {} of {} refused: {}", log_ref(key), address, exc.code.value)
        logger.debug("Request {} refused: {}", key, exc.message)
        self.stats.record_error(exc.code.value)
        reply = ErrorReply(
            session_id=address.session, request_id=key, error=ErrorBody(code=exc.code, message=exc.message)
        )
        return reply.to_json()

    def _answer_error(
        self,
        message: InboundMessage,
        address: SessionAddress,
        target: ReplyTarget,
        key: str | None,
        exc: RequestError,
    ) -> None:
        """Answer a request with an error at once (nothing generated, nothing stored)."""
        self._answer([message], target, self._error_payload(address, key, exc))

    def _forget_if_idle(self, address: SessionAddress, runtime: SessionRuntime) -> None:
        idle = not runtime.messages and not runtime.running and not runtime.lock.locked() and runtime.waiting == 0
        if idle and self._runtime.get(str(address)) is runtime:
            del self._runtime[str(address)]

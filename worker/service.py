"""The service: MQTT messages in, engine generations, replies and stats out.

One asyncio loop owns all state. Each request becomes a task that waits for its session's
lock (asyncio locks are FIFO, so a session's turns run in arrival order) and then streams
from the engine; tasks of different sessions run at once, and the engine batches them
continuously. Every inbound message is acknowledged exactly when it has been answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from loguru import logger

from .config import WorkerConfig
from .engine import Engine, EngineDead
from .history import HistoryLimits, PromptRenderer
from .messages import (
    ChatRequest,
    ControlReply,
    ErrorBody,
    ErrorCode,
    ErrorReply,
    RequestError,
    best_effort_request_id,
    parse_chat_request,
    parse_control,
    request_key,
)
from .packets import fit_answer
from .ratelimit import RateLimiter
from .stats import StatsCollector
from .store import HistoryStore, MemoryStore, SessionCache
from .topics import Inbound, InvalidTopic, SessionAddress, Topics, topic_matches
from .transport import InboundMessage
from .turns import PendingTurn, Publisher, ReplyTarget, SessionRuntime, TurnRunner

DISPATCH_TRIES = 60


class Transport(Publisher, Protocol):
    inbox: asyncio.Queue[InboundMessage]

    def ack(self, message: InboundMessage) -> None: ...


class Service:
    def __init__(
        self,
        config: WorkerConfig,
        engine: Engine,
        renderer: PromptRenderer,
        transport: Transport,
        stop_requested: Callable[[int], None],
        store: HistoryStore | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.renderer = renderer
        self.transport = transport
        self.topics = Topics(config.mqtt.topic_prefix)
        self.worker_id = config.effective_worker_id
        self.sessions = SessionCache(store or MemoryStore(), config.history.max_sessions)
        self.stats = StatsCollector(self.worker_id)
        self._runtime: dict[str, SessionRuntime] = {}
        self.rate_limiter = RateLimiter(config.limits.max_requests_per_user_per_minute)
        self._tasks: set[asyncio.Task[None]] = set()
        self._requests: set[asyncio.Task[None]] = set()  # of _tasks: requests in flight
        self._stop_requested = stop_requested
        self._draining = False
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
        )

    @property
    def pending(self) -> int:
        return len(self._requests)

    # -- main loops ---------------------------------------------------------------------

    async def consume(self) -> None:
        while True:
            message = await self.transport.inbox.get()
            if self._draining:
                # Left unacknowledged: the broker delivers it again after the restart.
                logger.info("Stopping: {} left unacknowledged for the next start", message.topic)
                continue
            try:
                self.dispatch(message)
            except Exception:  # one bad message must not stop the worker
                logger.exception("unexpected error handling a message on {}", message.topic)
                self._after_failure(message)
            else:
                if self._failures and message.entry is not None:
                    self._failures.pop(message.entry, None)

    def _after_failure(self, message: InboundMessage) -> None:
        """Drop a message that could not be handled (acknowledged, unanswered), unless it came
        from the Redis intake and has tries left: it is handed in again a second later, so an
        unreachable store for a while (up to DISPATCH_TRIES s) loses no request."""
        if message.entry is not None:
            tries = self._failures.get(message.entry, 0) + 1
            if tries < DISPATCH_TRIES:
                self._failures[message.entry] = tries
                asyncio.get_running_loop().call_later(1.0, self.transport.inbox.put_nowait, message)
                return
            self._failures.pop(message.entry, None)
        self.transport.ack(message)

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
            expired = self.sessions.expire(ttl)
            if expired:
                logger.info("Expired {} session(s) idle for over {:.0f}s", expired, ttl)
            await asyncio.sleep(min(ttl / 10, 600))

    def publish_stats(self) -> None:
        report = self.stats.report(self.engine.take_stats(), sessions=len(self.sessions), pending=self.pending)
        logger.info(report.log_line())
        self.transport.publish(self.topics.stats(self.worker_id), report.to_json(), qos=1, retain=True)

    async def drain(self, timeout: float) -> None:
        """Let running generations finish (up to timeout), then abort the rest unanswered:
        they stay unacknowledged and the broker redelivers them after a restart."""
        # Not an unsubscribe: that would empty the broker's persistent session, and requests
        # sent while the worker is down would be lost instead of queued for its restart.
        self._draining = True
        if self._tasks:
            logger.info("Draining {} pending request(s) for up to {:.0f}s", len(self._tasks), timeout)
            _, still_running = await asyncio.wait(set(self._tasks), timeout=timeout)
            for task in still_running:
                task.cancel()
            if still_running:
                logger.warning("Stopped {} unfinished request(s); they are left unacknowledged", len(still_running))
                await asyncio.wait(still_running, timeout=5)

    # -- dispatch -----------------------------------------------------------------------

    def dispatch(self, message: InboundMessage) -> None:
        try:
            address, kind = self.topics.parse(message.topic)
        except InvalidTopic as exc:
            logger.warning("Ignoring message on invalid topic {!r}: {}", message.topic[:300], exc)
            self.stats.record_invalid_topic()
            self.transport.ack(message)
            return
        if message.retain:
            # A retained request would be replayed to every worker that subscribes: never run it.
            logger.warning("Ignoring retained message on {}", message.topic)
            self.transport.ack(message)
            return
        if kind is Inbound.CONTROL:
            self._dispatch_control(message, address)
        else:
            self._dispatch_request(message, address)

    def _runtime_for(self, address: SessionAddress) -> SessionRuntime:
        return self._runtime.setdefault(str(address), SessionRuntime())

    def _spawn(self, coro: Coroutine[Any, Any, None], *, request: bool = False) -> None:
        """Run coro as a task the drain waits for; a request's task also counts as pending."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        if request:
            self._requests.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._requests.discard(task)
        if not task.cancelled():
            exc = task.exception()
            if exc is not None and not isinstance(exc, EngineDead):
                logger.opt(exception=exc).error("Request task failed")

    def _dispatch_request(self, message: InboundMessage, address: SessionAddress) -> None:
        request_id = best_effort_request_id(message.payload, self.config.limits.max_payload_bytes)
        key = request_key(message.topic, message.payload, request_id)
        target = self._reply_target(message, address)
        history = self.sessions.get(str(address))
        if key in history.answered:
            stored = history.answered[key]
            if stored is None:  # answered before a reset deleted the text: nothing to resend
                logger.info("Request {} of {} was answered before the session's reset: acknowledged", key, address)
                self.transport.ack(message)
            else:
                logger.info("Request {} of {} already answered: publishing the stored reply", key, address)
                self._answer([message], target, stored)
            return
        runtime = self._runtime_for(address)
        if key in runtime.messages:
            logger.info("Request {} of {} is a redelivery of one in progress", key, address)
            runtime.messages[key].append(message)
            return
        try:
            self._check_rate(address)
            request = parse_chat_request(message.payload, address.session, self.config.limits.max_payload_bytes)
            self._admit(request, runtime)
        except RequestError as exc:
            self._answer_error(message, address, target, key, exc)
            self._forget_if_idle(address, runtime)  # else every refused session would stay
            return
        deliveries = self.sessions.store.count_delivery(str(address), key)
        if deliveries > self.config.limits.max_deliveries:
            # Delivered again and again without an answer: it crashed the worker (or its
            # engine) each time. A final error ends the loop.
            logger.error("Request {} of {} is poison ({} deliveries without an answer)", key, address, deliveries - 1)
            poison = RequestError(
                ErrorCode.ENGINE_ERROR,
                f"the request was tried {deliveries - 1} times and never completed; it is not tried again",
            )
            self._answer_error(message, address, target, key, poison, store=True)
            self._forget_if_idle(address, runtime)
            return
        runtime.messages[key] = [message]
        runtime.waiting += 1
        deadline = self._deadline(message)
        self._spawn(
            self._run_turn(PendingTurn(message, address, target, key, request, runtime, deadline)), request=True
        )

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
            self._cancel(address, runtime, control.request_id)
            self.transport.ack(message)
        elif control.action == "reset":
            runtime.waiting += 1
            self._spawn(self._reset(message, address, target, runtime), request=True)
        else:
            unsupported = RequestError(
                ErrorCode.UNSUPPORTED_ACTION, f"unknown action {control.action[:40]!r}; use reset or cancel"
            )
            self._answer_error(message, address, target, control.request_id, unsupported)
        self._forget_if_idle(address, runtime)

    def _cancel(self, address: SessionAddress, runtime: SessionRuntime, key: str | None) -> None:
        if key is None:
            logger.info("Cancel for {} without requestId ignored", address)
        elif key in runtime.running:
            logger.info("Cancelling running request {} of {}", key, address)
            self._spawn(self.engine.abort(runtime.running[key]))
        elif key in runtime.messages:
            logger.info("Cancelling queued request {} of {}", key, address)
            runtime.cancelled.add(key)
        else:
            logger.info("Cancel for {} of {}: nothing in flight", key, address)

    async def _reset(
        self, message: InboundMessage, address: SessionAddress, target: ReplyTarget, runtime: SessionRuntime
    ) -> None:
        try:
            async with runtime.lock:  # in order with the session's turns
                runtime.waiting -= 1
                self.sessions.reset(str(address))
                logger.info("Session {} reset", address)
            await self._confirmed_answer(
                [message], target, ControlReply(session_id=address.session, action="reset").to_json()
            )
        finally:
            self._forget_if_idle(address, runtime)

    # -- one turn -----------------------------------------------------------------------

    async def _run_turn(self, turn: PendingTurn) -> None:
        """Generate, store the turn with its answer (one transaction), publish the answer,
        and acknowledge the request only once the broker has the answer (its PUBACK)."""
        message, address, target, key, runtime = turn.message, turn.address, turn.target, turn.key, turn.runtime
        name = str(address)
        stored = False
        try:
            async with runtime.lock:
                runtime.waiting -= 1
                history = self.sessions.get(name)
                try:
                    payload = await self.turns.run(turn, history)
                except RequestError as exc:
                    payload = self._error_payload(address, key, exc)
                    self.sessions.save(name, history, key, None)  # an error is not a stored answer
                else:
                    first = self.sessions.save(name, history, key, payload)
                    if first is not None:  # a worker taken for dead answered it too, first
                        logger.warning("Request {} of {} was answered by another worker first", key, address)
                        payload = first
                stored = True
            await self._confirmed_answer(runtime.messages.get(key, [message]), target, payload)
        except asyncio.CancelledError:
            # Shutting down: the work was interrupted and has no answer yet (or its answer is
            # stored but not confirmed). Left unacknowledged, the broker redelivers it after
            # the restart; a stop is not the request's fault, so it does not count as a try.
            if not stored:
                self.sessions.store.uncount_delivery(name, key)
            raise
        except EngineDead:
            raise  # left unacknowledged and counted: the request may be what killed the engine
        except Exception:  # a bug of ours: answer rather than leave the client waiting
            logger.exception("Unexpected error on request {} of {}", key, address)
            error = RequestError(ErrorCode.ENGINE_ERROR, "internal error")
            await self._confirmed_answer(
                runtime.messages.get(key, [message]), target, self._error_payload(address, key, error)
            )
        finally:
            runtime.messages.pop(key, None)
            runtime.cancelled.discard(key)
            self._forget_if_idle(address, runtime)

    # -- replies ------------------------------------------------------------------------

    def _reply_target(self, message: InboundMessage, address: SessionAddress) -> ReplyTarget:
        own = self.topics.reply(address)
        wanted = message.response_topic
        if wanted and wanted != own:
            allowed = not any(c in wanted for c in "+#") and any(
                topic_matches(pattern, wanted) for pattern in self.config.mqtt.allowed_response_topics
            )
            if not allowed:
                logger.warning("ResponseTopic {!r} of {} is not allowed; replying on {}", wanted[:300], address, own)
                wanted = None
        return ReplyTarget(wanted or own, message.correlation_data)

    def _publish(self, target: ReplyTarget, payload: bytes) -> asyncio.Future[None]:
        limit = self.transport.payload_limit(target.topic, qos=1, correlation_data=target.correlation_data)
        fitted = fit_answer(payload, limit)
        if fitted is None:
            logger.error("An answer on {} does not fit the broker's maximum packet size: not sent", target.topic)
            nothing: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            nothing.set_result(None)
            return nothing
        if fitted is not payload:
            logger.warning("An answer on {} was cut to the broker's maximum packet size", target.topic)
        return self.transport.publish(target.topic, fitted, qos=1, correlation_data=target.correlation_data)

    async def _confirmed_answer(self, messages: list[InboundMessage], target: ReplyTarget, payload: bytes) -> None:
        """Publish an answer; acknowledge the request (and its redelivered copies) once the
        broker has taken the answer. Until then a crash leaves the request to be delivered
        again, and it is answered from the store."""
        await self._publish(target, payload)
        for copy in messages:
            self.transport.ack(copy)

    def _answer(self, messages: list[InboundMessage], target: ReplyTarget, payload: bytes) -> None:
        self._spawn(self._confirmed_answer(messages, target, payload))

    def _error_payload(self, address: SessionAddress, key: str | None, exc: RequestError) -> bytes:
        logger.info("Request {} of {} refused: {} ({})", key, address, exc.code.value, exc.message)
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
        *,
        store: bool = False,
    ) -> None:
        """Answer a request with an error at once (nothing generated). With store, the error
        is its final answer: a redelivery gets it again."""
        payload = self._error_payload(address, key, exc)
        if store and key is not None:
            name = str(address)
            self.sessions.save(name, self.sessions.get(name), key, payload)
        self._answer([message], target, payload)

    def _forget_if_idle(self, address: SessionAddress, runtime: SessionRuntime) -> None:
        idle = not runtime.messages and not runtime.running and not runtime.lock.locked() and runtime.waiting == 0
        if idle and self._runtime.get(str(address)) is runtime:
            del self._runtime[str(address)]

"""Redis adapter: the shared history store, and the durable intake's streams and leases.

The only module that imports redis. Two clients over one URL: a synchronous one for the
history store (the store's contract is synchronous, and a turn makes two or three calls of
well under a millisecond on a LAN), and an asyncio one for the intake, whose consumer blocks
on XREADGROUP.

Keys, all under the topic prefix P (workers of one group share it):

P:{<session>}:state      the session's JSON state (as SQLite's sessions.state)
P:{<session>}:answers    hash: request key -> reply payload ("" is a tombstone after a reset)
P:{<session>}:order      sorted set: request key by time, to keep the newest 256 answers
P:{<session>}:deliveries hash: request key -> deliveries without an answer
P:instances              set of worker instances (one per worker process start)
P:alive:<instance>       the instance's heartbeat (expires after worker_lease)
P:stream:<instance>      the instance's intake stream (consumer group "workers")
P:owner:<session>        the instance that owns the session (expires after owner_lease)
P:moved:<instance>       where a dead instance's stream went (expires after owner_lease)

A session's keys share a hash tag ({...}), so its save script is valid on a Redis Cluster;
the intake's scripts name streams of other instances and need one primary (or Sentinel).
Every multi-key change is one Lua script: atomic, no home-made locking.
"""

from __future__ import annotations

import functools
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis

from .history import ANSWERED_KEYS_PER_SESSION, SessionHistory
from .store import StoreUnavailable, parse_state

GROUP = "workers"

# KEYS: state, answers, order, deliveries. ARGV: state json, key, payload ("" none), now,
# ttl ms (0: none), newest kept. Returns the payload already stored for key by another worker
# (then nothing is written), else false.
_SAVE = """
if ARGV[3] ~= '' then
  local stored = redis.call('HGET', KEYS[2], ARGV[2])
  if stored and stored ~= '' then return stored end
  redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
  redis.call('ZADD', KEYS[3], ARGV[4], ARGV[2])
  local old = redis.call('ZRANGE', KEYS[3], 0, -tonumber(ARGV[6]) - 1)
  if #old > 0 then
    redis.call('ZREM', KEYS[3], unpack(old))
    redis.call('HDEL', KEYS[2], unpack(old))
  end
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[2])
for i = 1, 4 do
  if ARGV[5] == '0' then redis.call('PERSIST', KEYS[i]) else redis.call('PEXPIRE', KEYS[i], ARGV[5]) end
end
return false
"""

# KEYS: state, answers. Deletes the conversation, blanks the answers' text (tombstones).
_RESET = """
redis.call('DEL', KEYS[1])
local keys = redis.call('HKEYS', KEYS[2])
for _, key in ipairs(keys) do redis.call('HSET', KEYS[2], key, '') end
return #keys
"""

# KEYS: owner key of the session. ARGV: prefix, this instance, owner lease ms, then the
# entry's fields. The session's owner (following moved: links of dead instances), or this
# instance when it has none; the entry goes to the end of the owner's stream. An instance
# that was taken over claims nothing (its stream is gone: the entry would be read by no one):
# it gives the session to a live member.
_ROUTE = """
local prefix = ARGV[1]
local instances = prefix .. 'instances'
local owner = redis.call('GET', KEYS[1])
local hops = 0
while owner do
  local moved = redis.call('GET', prefix .. 'moved:' .. owner)
  if not moved then break end
  owner = moved
  hops = hops + 1
  if hops > 32 then owner = false end
end
if owner and redis.call('SISMEMBER', instances, owner) == 0 then owner = false end
if not owner then
  if redis.call('SISMEMBER', instances, ARGV[2]) == 1 then
    owner = ARGV[2]
  else
    owner = redis.call('SRANDMEMBER', instances)
    if not owner then return redis.error_reply('NOMEMBER no live worker instance') end
  end
end
redis.call('SET', KEYS[1], owner, 'PX', ARGV[3])
local id = redis.call('XADD', prefix .. 'stream:' .. owner, '*', unpack(ARGV, 4))
return {owner, id}
"""

# ARGV: prefix, dead instance, this instance, owner lease ms. Moves every entry left in the
# dead instance's stream (pending or unread: acknowledged entries are deleted) to the end of
# this instance's stream, in order, and links the dead one to this one. -1: it is alive,
# -2: already taken over, -3: this instance is no longer alive itself.
_TAKE_OVER = """
local prefix, dead, me = ARGV[1], ARGV[2], ARGV[3]
if redis.call('EXISTS', prefix .. 'alive:' .. dead) == 1 then return -1 end
if redis.call('SISMEMBER', prefix .. 'instances', dead) == 0 then return -2 end
if redis.call('EXISTS', prefix .. 'alive:' .. me) == 0 then return -3 end
local entries = redis.call('XRANGE', prefix .. 'stream:' .. dead, '-', '+')
for _, entry in ipairs(entries) do
  redis.call('XADD', prefix .. 'stream:' .. me, '*', unpack(entry[2]))
end
redis.call('DEL', prefix .. 'stream:' .. dead)
redis.call('SET', prefix .. 'moved:' .. dead, me, 'PX', ARGV[4])
redis.call('SREM', prefix .. 'instances', dead)
return #entries
"""

# ARGV: prefix, this instance, worker lease ms. 0: the instance was taken over (fenced).
_HEARTBEAT = """
if redis.call('SISMEMBER', ARGV[1] .. 'instances', ARGV[2]) == 0 then return 0 end
redis.call('SET', ARGV[1] .. 'alive:' .. ARGV[2], '1', 'PX', ARGV[3])
return 1
"""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


T = TypeVar("T")


def _guarded(method: Callable[..., T]) -> Callable[..., T]:
    """RedisStore methods: Redis unreachable or failing is StoreUnavailable (store.py)."""

    @functools.wraps(method)
    def guarded(*args: Any, **kwargs: Any) -> T:
        try:
            return method(*args, **kwargs)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"the Redis store failed: {exc}") from exc

    return guarded


ASYNC_CONNECTIONS = 64  # per worker, for the intake's concurrent operations


class RedisStore:
    """The HistoryStore contract (store.py) on Redis, shared by the workers of a group.

    Sessions expire by Redis's own key expiry (session_ttl after their last save), so
    expire() has nothing to do. save() of an answer is conditional: the first answer stored
    for a request key stands, a second one (a worker that was taken for dead but was only
    slow) is not written, and the stored one is returned for publishing instead."""

    shared = True

    def __init__(self, url: str, prefix: str, session_ttl: float) -> None:
        self._db = redis.Redis.from_url(url)
        self._db.ping()  # fail at start, not at the first request
        self._prefix = prefix
        self._ttl_ms = int(session_ttl * 1000)
        self._save = self._db.register_script(_SAVE)
        self._reset = self._db.register_script(_RESET)

    def _keys(self, session: str) -> list[str]:
        tag = f"{self._prefix}:{{{session}}}"
        return [f"{tag}:state", f"{tag}:answers", f"{tag}:order", f"{tag}:deliveries"]

    @_guarded
    def load(self, session: str) -> SessionHistory | None:
        state_key, answers_key, order_key, _ = self._keys(session)
        pipe = self._db.pipeline(transaction=True)
        pipe.get(state_key)
        pipe.hgetall(answers_key)
        pipe.zrange(order_key, 0, -1)
        state, answers, order = pipe.execute()
        if state is None and not answers:
            return None
        history = SessionHistory()
        if state is not None:
            history.system_prompt, history.turns = parse_state(session, state)
        answered: OrderedDict[str, bytes | None] = OrderedDict()
        for key in order:
            payload = answers.get(key)
            if payload is not None:
                answered[_text(key)] = payload or None
        history.answered = answered
        return history

    @_guarded
    def save(self, session: str, history: SessionHistory, key: str, payload: bytes | None) -> bytes | None:
        turns = [{"key": t.key, "user": t.user, "assistant": t.assistant} for t in history.turns]
        state = json.dumps({"systemPrompt": history.system_prompt, "turns": turns}, ensure_ascii=False)
        args: list[str | bytes | int] = [
            state,
            key,
            payload or b"",
            repr(time.time()),
            self._ttl_ms,
            ANSWERED_KEYS_PER_SESSION,
        ]
        stored = self._save(keys=self._keys(session), args=args)
        return bytes(stored) if stored else None

    @_guarded
    def reset(self, session: str) -> None:
        self._reset(keys=self._keys(session)[:2])

    @_guarded
    def count_delivery(self, session: str, key: str) -> int:
        deliveries = self._keys(session)[3]
        pipe = self._db.pipeline(transaction=True)
        pipe.hincrby(deliveries, key, 1)
        if self._ttl_ms:
            pipe.pexpire(deliveries, self._ttl_ms)
        return int(pipe.execute()[0])

    @_guarded
    def uncount_delivery(self, session: str, key: str) -> None:
        deliveries = self._keys(session)[3]
        if int(self._db.hget(deliveries, key) or 0) > 0:
            self._db.hincrby(deliveries, key, -1)

    def expire(self, idle_seconds: float) -> list[str]:
        return []  # Redis expires the keys itself (session_ttl, set on every save)

    def close(self) -> None:
        self._db.close()


class RedisStreams:
    """The intake's side of Redis: one instance's stream, its heartbeat, routing to session
    owners and taking over the streams of dead instances (see intake.py for the design)."""

    def __init__(self, url: str, prefix: str, instance: str, *, worker_lease: float, owner_lease: float) -> None:
        # A blocking pool: a burst of acknowledgements and routes waits for a connection.
        # redis-py's default pool raises "Too many connections" past 100 at once (seen with
        # 10 workers at 1,000 sessions/s; the operations retried, but logged errors).
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=ASYNC_CONNECTIONS, timeout=None)
        self._db: Any = aioredis.Redis(connection_pool=pool)
        self._prefix = f"{prefix}:"
        self.instance = instance
        self._worker_lease_ms = int(worker_lease * 1000)
        self._owner_lease_ms = int(owner_lease * 1000)
        self.stream = f"{self._prefix}stream:{instance}"
        self._route = self._db.register_script(_ROUTE)
        self._take_over = self._db.register_script(_TAKE_OVER)
        self._heartbeat = self._db.register_script(_HEARTBEAT)

    async def register(self) -> None:
        """Join: a live heartbeat, a place in the instance set, an empty stream with its group."""
        await self._db.set(f"{self._prefix}alive:{self.instance}", "1", px=self._worker_lease_ms)
        await self._db.sadd(f"{self._prefix}instances", self.instance)
        await self._db.xgroup_create(self.stream, GROUP, id="0", mkstream=True)

    async def heartbeat(self) -> bool:
        """Renew the heartbeat; False when this instance was taken for dead and taken over."""
        return bool(await self._heartbeat(args=[self._prefix, self.instance, self._worker_lease_ms]))

    async def leave(self) -> None:
        """Stop heartbeating: what is left in the stream goes to the next worker that sweeps."""
        await self._db.delete(f"{self._prefix}alive:{self.instance}")

    async def route(self, session: str, fields: dict[str, bytes]) -> tuple[str, str]:
        """Append an entry to the stream of the session's owner; (owner, entry id)."""
        flat = [item for pair in fields.items() for item in pair]
        owner, entry = await self._route(
            keys=[f"{self._prefix}owner:{session}"],
            args=[self._prefix, self.instance, self._owner_lease_ms, *flat],
        )
        return _text(owner), _text(entry)

    async def append(self, fields: dict[str, bytes]) -> str:
        """Append an entry to this instance's own stream, whoever owns its session (no
        affinity: for measuring what the owner routing is worth)."""
        return _text(await self._db.xadd(self.stream, fields))

    async def read(self, count: int, block_ms: int) -> list[tuple[str, dict[str, bytes]]]:
        """New entries of this instance's stream, in order (blocks up to block_ms)."""
        answer = await self._db.xreadgroup(GROUP, self.instance, {self.stream: ">"}, count=count, block=block_ms)
        entries: list[tuple[str, dict[str, bytes]]] = []
        for _, stream_entries in answer or []:
            for entry_id, fields in stream_entries:
                entries.append((_text(entry_id), {_text(k): bytes(v) for k, v in fields.items()}))
        return entries

    async def ack(self, entry_id: str) -> None:
        """Done with the entry: acknowledged and deleted (the stream holds only open work)."""
        pipe = self._db.pipeline(transaction=True)
        pipe.xack(self.stream, GROUP, entry_id)
        pipe.xdel(self.stream, entry_id)
        await pipe.execute()

    async def dead_instances(self) -> list[str]:
        members = [_text(m) for m in await self._db.smembers(f"{self._prefix}instances")]
        others = [m for m in members if m != self.instance]
        if not others:
            return []
        alive = await self._db.mget([f"{self._prefix}alive:{m}" for m in others])
        return [m for m, beat in zip(others, alive, strict=True) if beat is None]

    async def take_over(self, dead: str) -> int:
        """Move a dead instance's open entries to this instance's stream; how many (negative:
        nothing done, see _TAKE_OVER)."""
        return int(await self._take_over(args=[self._prefix, dead, self.instance, self._owner_lease_ms]))

    async def close(self) -> None:
        await self._db.aclose()

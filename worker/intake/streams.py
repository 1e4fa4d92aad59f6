"""The intake's side of Redis (the design: group.py).

One instance's stream, its heartbeat, routing to session owners and taking over the streams of
dead instances.

An asyncio client: the intake's consumer blocks on XREADGROUP. Keys, all under the topic
prefix P (the store's keys: store/redis.py):

P:instances              set of worker instances (one per worker process start)
P:alive:<instance>       the instance's heartbeat (expires after worker_lease)
P:stream:<instance>      the instance's intake stream (consumer group "workers")
P:owner:<session>        the instance that owns the session (expires after owner_lease)
P:moved:<instance>       where a dead instance's stream went (expires after owner_lease)

The scripts name streams of other instances and need one primary (or Sentinel). Every
multi-key change is one Lua script: atomic, no home-made locking.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

GROUP = "workers"

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


ASYNC_CONNECTIONS = 64  # per worker, for the intake's concurrent operations


class RedisStreams:
    """The intake's side of Redis: one instance's stream, its heartbeat, routing to session
    owners and taking over the streams of dead instances (see group.py for the design)."""

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

"""The session store on Redis (history.store = "redis"), shared by a group's workers.

The workers of a share group see each other's sessions. The intake's streams and leases on the same Redis are in
intake/streams.py.

A synchronous client: the store's contract is synchronous, and a turn makes two or three calls
of well under a millisecond on a LAN.

Keys, all under the topic prefix P (workers of one group share it):

P:{<session>}:state      the session's JSON state (as SQLite's sessions.state)
P:{<session>}:answers    hash: request key -> reply payload ("" is a tombstone after a reset)
P:{<session>}:order      sorted set: request key by time, to keep the newest 256 answers
P:{<session>}:deliveries hash: request key -> deliveries without an answer
P:{<session>}:images     hash: image sha256 -> media type, a newline, the image's bytes
P:{<session>}:progress   hash: request key -> its tool-loop progress (port.py encode_progress)

A session's images are kept apart from its state, which names them by hash: each is written
once (HSETNX) by the save script of the turn that first refers to it, and deleted by the one
that trims the last turn showing it. A save sends only the bytes of images Redis does not hold
yet: it first runs with none, and the script, finding a referenced image missing, writes
nothing and names the missing ones; the save runs again with their bytes (and, should another
worker's reset delete others in between, a third time with all of them).

A session's keys share a hash tag ({...}), so its save script is valid on a Redis Cluster.
Every multi-key change is one Lua script: atomic, no home-made locking.
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from ..session import ANSWERED_KEYS_PER_SESSION, SessionHistory, StoredImage
from .port import StoreUnavailable, encode_state, missing_images, parse_state, referenced_images

# KEYS: state, answers, order, deliveries, images. ARGV: state json, key, payload ("" none),
# now, ttl ms (0: none), newest kept, then n, the n image hashes the state refers to, m, the m
# of them whose bytes the caller has, then (hash, media type "\n" bytes) pairs to write.
# Returns the payload already stored for key by another worker (then nothing is written); or
# {"missing", hash...}: images the state needs that neither Redis nor the call holds (nothing
# is written; the caller sends them); else false.
_SAVE = """
if ARGV[3] ~= '' then
  local stored = redis.call('HGET', KEYS[2], ARGV[2])
  if stored and stored ~= '' then return stored end
end
local n = tonumber(ARGV[7])
local referenced = {}
for i = 8, 7 + n do referenced[ARGV[i]] = true end
local m = tonumber(ARGV[8 + n])
local sent = {}
for i = 9 + n + m, #ARGV, 2 do sent[ARGV[i]] = ARGV[i + 1] end
local missing = {}
for i = 9 + n, 8 + n + m do
  local sha = ARGV[i]
  if not sent[sha] and redis.call('HEXISTS', KEYS[5], sha) == 0 then missing[#missing + 1] = sha end
end
if #missing > 0 then return {'missing', unpack(missing)} end
for sha, image in pairs(sent) do redis.call('HSETNX', KEYS[5], sha, image) end
for _, sha in ipairs(redis.call('HKEYS', KEYS[5])) do
  if not referenced[sha] then redis.call('HDEL', KEYS[5], sha) end
end
if ARGV[3] ~= '' then
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
for i = 1, 5 do
  if ARGV[5] == '0' then redis.call('PERSIST', KEYS[i]) else redis.call('PEXPIRE', KEYS[i], ARGV[5]) end
end
return false
"""

# KEYS: state, answers, images. Deletes the conversation and its images, blanks the answers'
# text (tombstones).
_RESET = """
redis.call('DEL', KEYS[1], KEYS[3])
local keys = redis.call('HKEYS', KEYS[2])
for _, key in ipairs(keys) do redis.call('HSET', KEYS[2], key, '') end
return #keys
"""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


T = TypeVar("T")


def _guarded(method: Callable[..., T]) -> Callable[..., T]:
    """RedisStore methods: Redis unreachable or failing is StoreUnavailable (port.py)."""

    @functools.wraps(method)
    def guarded(*args: Any, **kwargs: Any) -> T:
        try:
            return method(*args, **kwargs)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"the Redis store failed: {exc}") from exc

    return guarded


class RedisStore:
    """The HistoryStore contract (port.py) on Redis, shared by the workers of a group.

    Sessions expire by Redis's own key expiry (session_ttl after their last save), so
    expire() has nothing to do. save() of an answer is conditional: the first answer stored
    for a request key stands, a second one (a worker that was taken for dead but was only
    slow) is not written, and the stored one is returned for publishing instead."""

    shared = True
    waits = True  # across the network

    def __init__(self, url: str, prefix: str, session_ttl: float) -> None:
        self._db = redis.Redis.from_url(url)
        self._db.ping()  # fail at start, not at the first request
        self._prefix = prefix
        self._ttl_ms = int(session_ttl * 1000)
        self._save = self._db.register_script(_SAVE)
        self._reset = self._db.register_script(_RESET)

    def _keys(self, session: str) -> list[str]:
        tag = f"{self._prefix}:{{{session}}}"
        return [f"{tag}:state", f"{tag}:answers", f"{tag}:order", f"{tag}:deliveries", f"{tag}:images"]

    @_guarded
    def load(self, session: str) -> SessionHistory | None:
        state_key, answers_key, order_key, _, images_key = self._keys(session)
        pipe = self._db.pipeline(transaction=True)
        pipe.get(state_key)
        pipe.hgetall(answers_key)
        pipe.zrange(order_key, 0, -1)
        # Every image the hash holds is one the state refers to (a save deletes the others):
        # read with the state, in one transaction, so a save by another worker in between
        # cannot leave a state naming an image that was read before it was written.
        pipe.hgetall(images_key)
        state, answers, order, images = pipe.execute()
        if state is None and not answers:
            return None
        history = parse_state(session, state) if state is not None else SessionHistory()
        missing = missing_images(history)
        for sha, value in images.items():
            if _text(sha) in missing:
                media_type, _, data = bytes(value).partition(b"\n")
                history.images[_text(sha)] = StoredImage(data, media_type.decode())
        answered: OrderedDict[str, bytes | None] = OrderedDict()
        for key in order:
            payload = answers.get(key)
            if payload is not None:
                answered[_text(key)] = payload or None
        history.answered = answered
        return history

    @_guarded
    def save(self, session: str, history: SessionHistory, key: str, payload: bytes | None) -> bytes | None:
        referenced = sorted(referenced_images(history))
        have = [sha for sha in referenced if sha in history.images]
        head: list[str | bytes | int] = [
            encode_state(history),
            key,
            payload or b"",
            repr(time.time()),
            self._ttl_ms,
            ANSWERED_KEYS_PER_SESSION,
            len(referenced),
            *referenced,
            len(have),
            *have,
        ]
        stored = self._save(keys=self._keys(session), args=head)
        if isinstance(stored, list):  # images Redis does not hold yet: again, with their bytes
            stored = self._save(keys=self._keys(session), args=head + self._images(history, stored[1:]))
        if isinstance(stored, list):  # another was deleted meanwhile (another worker's reset): all of them
            stored = self._save(keys=self._keys(session), args=head + self._images(history, have))
        assert not isinstance(stored, list), "the save script found an image missing that it was sent"
        # Not in the script: a progress left behind is never read, since the answer is found first.
        self._db.hdel(self._progress_key(session), key)
        return bytes(stored) if stored else None

    @staticmethod
    def _images(history: SessionHistory, hashes: list[Any]) -> list[str | bytes | int]:
        """The save script's (hash, media type "\n" bytes) pairs for these images."""
        pairs: list[str | bytes | int] = []
        for sha in map(_text, hashes):
            image = history.images[sha]
            pairs += [sha, image.media_type.encode() + b"\n" + image.data]
        return pairs

    @_guarded
    def reset(self, session: str) -> None:
        state_key, answers_key, _, _, images_key = self._keys(session)
        self._reset(keys=[state_key, answers_key, images_key])
        self._db.delete(self._progress_key(session))

    def _progress_key(self, session: str) -> str:
        return f"{self._prefix}:{{{session}}}:progress"

    @_guarded
    def save_progress(self, session: str, key: str, progress: str) -> None:
        pipe = self._db.pipeline(transaction=True)
        pipe.hset(self._progress_key(session), key, progress)
        if self._ttl_ms:
            pipe.pexpire(self._progress_key(session), self._ttl_ms)
        pipe.execute()

    @_guarded
    def load_progress(self, session: str, key: str) -> str | None:
        value = self._db.hget(self._progress_key(session), key)
        return _text(value) if value is not None else None

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

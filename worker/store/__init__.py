"""Where sessions live between requests and across restarts.

- ``port.py``: the HistoryStore contract, its typed faults, the stored state's encoding
- ``sqlite.py``: the default, one SQLite file in ``history.state_dir``
- ``memory.py``: this process's memory (tests, throwaway runs)
- ``redis.py``: Redis, shared by the workers of a share group (imports redis, optional)
"""

from __future__ import annotations

from loguru import logger

from ..config.models import HistoryConfig, RedisConfig
from .port import HistoryStore


def open_store(config: HistoryConfig, redis: RedisConfig, prefix: str) -> HistoryStore:
    """The store the configuration names. Each adapter is imported here, when it is chosen: the
    core imports this package (its port) without SQLite or Redis."""
    if config.store == "memory":
        from .memory import MemoryStore

        return MemoryStore()
    if config.store == "redis":
        from .redis import RedisStore  # imports redis, an optional dependency

        logger.info("Sessions are stored in Redis, shared with the worker's group")
        return RedisStore(redis.url, prefix, config.session_ttl)
    from .sqlite import SqliteStore

    store = SqliteStore(config.state_dir)
    logger.info("Sessions are stored in {}", store.path)
    return store

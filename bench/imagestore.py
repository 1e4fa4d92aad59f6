"""What a session's images cost the session store: save and load times per turn.

    python -m bench.imagestore [--images 8] [--image-mb 1] [--turns 10] [--redis] [--out FILE]

One session on the SQLite store (a fresh database in a temporary directory; with ``--redis``
also on a redis-server that the benchmark starts, as the tests do): its first turn brings
``--images`` images of ``--image-mb`` MB each (random bytes: the store never decodes them),
the next turns are text only and keep the images in the history. Each turn is saved as the
service commits it (SessionCache.save) and the session is then loaded as a worker that does
not hold it in memory does (the store's load): both timed. Reported: the first turn's save,
and the median save and load of the text turns that follow, with the stored state's size.

The images used to be kept inside the state, so that every save wrote them again; they are
kept apart now, each written once (docs/performance.md, "The session store and images").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from worker.core.session_cache import SessionCache
from worker.session import ImageRef, StoredImage, Turn, UserMessage, assistant_message
from worker.store.port import HistoryStore, encode_state


def run(store: HistoryStore, images: int, image_bytes: int, turns: int) -> dict[str, Any]:
    cache = SessionCache(store, capacity=10)
    blobs = [os.urandom(image_bytes) for _ in range(images)]
    refs = tuple(ImageRef(f"{i:064x}", "image/jpeg", 0) for i in range(images))
    saves, loads, sizes = [], [], []
    for n in range(turns):
        history = cache.get("u/s").draft()
        if n == 0:
            history.turns.append(Turn("k0", [UserMessage("what do you see?", refs), assistant_message("A door.")]))
            pairs = zip(refs, blobs, strict=True)
            history.images = {ref.sha256: StoredImage(blob, ref.media_type) for ref, blob in pairs}
        else:
            history.turns.append(Turn.plain(f"k{n}", f"and then {n}?", "The same door."))
        started = time.perf_counter()
        cache.save("u/s", history, f"k{n}", b'{"reply": "ok"}')
        saves.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        loaded = store.load("u/s")
        loads.append((time.perf_counter() - started) * 1000)
        assert loaded is not None and len(loaded.images) == images and len(loaded.turns) == n + 1
        sizes.append(len(encode_state(history).encode()))
    return {
        "first_save_ms": round(saves[0], 2),
        "save_ms_p50": round(statistics.median(saves[1:]), 2),
        "load_ms_p50": round(statistics.median(loads[1:]), 2),
        "state_bytes_last": sizes[-1],
        "saves_ms": [round(s, 2) for s in saves],
        "loads_ms": [round(s, 2) for s in loads],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--image-mb", type=float, default=1.0)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--redis", action="store_true", help="also on a redis-server started for the run")
    parser.add_argument("--out", type=Path, help="the results as JSON")
    args = parser.parse_args(argv)
    image_bytes = int(args.image_mb * (1 << 20))
    results: dict[str, Any] = {"images": args.images, "image_bytes": image_bytes, "turns": args.turns}
    with tempfile.TemporaryDirectory() as tmp:
        from worker.store.sqlite import SqliteStore

        results["sqlite"] = run(SqliteStore(Path(tmp) / "state"), args.images, image_bytes, args.turns)
        if args.redis:
            from devtools.redis_server import RedisServer
            from worker.store.redis import RedisStore

            (Path(tmp) / "redis").mkdir()
            server = RedisServer(Path(tmp) / "redis", appendonly=False, log=False)
            server.start()
            try:
                store = RedisStore(server.url, "bench", session_ttl=3600)
                results["redis"] = run(store, args.images, image_bytes, args.turns)
            finally:
                server.stop()
    for name in ("sqlite", "redis"):
        if name in results:
            r = results[name]
            print(
                f"{name}: first save {r['first_save_ms']} ms; then save p50 {r['save_ms_p50']} ms, "
                f"load p50 {r['load_ms_p50']} ms, state {r['state_bytes_last']} bytes"
            )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

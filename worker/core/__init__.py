"""The worker's logic, without I/O of its own.

It talks to the broker, the engine and the store through their ports (transport/port.py,
engine/port.py, store/port.py).

- ``service.py``: Service, one request's path from delivery to acknowledgement: dispatch,
  per-session order, admission, cancel and reset, the answer and the acknowledgement
- ``turns.py``: TurnRunner, one chat turn: prompt, generation, streaming, the committed reply
- ``history.py``: a session's prompt and its trimming to the context window; reasoning split
- ``sessions.py``: SessionCache, the live sessions in memory over the store
- ``tools.py``: tool calling: declared tools, results, calls checked, forced calls
- ``stats.py``: latency and usage statistics, published per worker
- ``ratelimit.py``: per-session request rate limits
"""

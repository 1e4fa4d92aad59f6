"""The worker's logic, without I/O of its own.

It talks to the broker, the engine and the store through their ports (transport/port.py,
engine/port.py, store/port.py).

- ``service.py``: Service, one request's path from delivery to acknowledgement: dispatch,
  per-session order, admission, cancel and reset, the answer and the acknowledgement
- ``pending.py``: the records a request's path passes on (PendingTurn, Generated, TurnAnswer)
- ``turns.py``: TurnRunner, one chat turn: prompt, generation, streaming, the committed reply
- ``rounds.py``: ToolRounds, the tool loop of one request (generate, run the worker's calls, again)
- ``worker_calls.py``: the worker's own tools in a request: offered, run, results cut, progress
- ``stream.py``: a request's stream deltas
- ``history.py``: a session's prompt and its trimming to the context window; reasoning split
- ``session_cache.py``: SessionCache, the live sessions in memory over the store
- ``calls.py``: tool calling: declared tools, results, calls checked, forced calls
- ``stats.py``: latency and usage statistics, published per worker
- ``ratelimit.py``: per-session request rate limits
"""

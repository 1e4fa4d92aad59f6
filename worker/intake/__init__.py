"""The durable intake of a share group (history.store = "redis").

Requests are routed to the worker that owns their session, through Redis streams that survive
a worker's death.

- ``group.py``: Intake, the transport the core sees in a group (design and guarantees)
- ``streams.py``: its Redis side (imports redis)
"""

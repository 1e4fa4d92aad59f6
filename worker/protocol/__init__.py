"""The wire: what frontends and the worker send each other over MQTT. Pure types and
functions, no I/O, no paho.

- ``messages.py``: the JSON bodies (requests, replies, errors, stream deltas, controls)
- ``topics.py``: the topic layout and its parsing
- ``packets.py``: fitting an answer into the broker's maximum packet size
- ``schemas.py``: the JSON Schemas in docs/schemas (``python -m worker.protocol.schemas``)
"""

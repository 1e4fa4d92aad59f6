"""Development tools shared by tests/, bench/ and scripts/, not shipped in the wheel.

Real parts started for a test or a benchmark run, fakes of the worker's ports, the tiny model
generator. Only ``worker`` is shipped; these are used from a checkout, with the repository root
on ``sys.path``.

Modules:

- ``tinymodel``: a tiny random chat model, or a real geometry without weights
  (``python -m devtools.tinymodel DIR``)
- ``net``: ``free_port``
- ``mosquitto``: a mosquitto broker on a free loopback port, owned by its caller
- ``redis_server``: a redis-server on a free loopback port, owned by its caller
- ``pki``: a test PKI made with openssl (CAs, broker, client and misnamed certificates)
- ``mqtt_client``: the MQTT clients of the tests and the benchmark: ``connect`` (a paho
  client, subscribed once the broker says so) and ``Client``, which records what it receives
- ``worker_process``: ``python -m worker`` in its own process group, online when its status
  says so, for the tests and the benchmark; and the engine settings of every test worker
- ``systemd``: the systemd side: a ``NOTIFY_SOCKET`` listener, the units' settings
- ``fakes``: fakes of the engine, renderer and transport ports, and a Service on them
- ``inproc``: the worker's own parts (worker/wiring.py) on a thread's event loop (fake engine)
- ``acl``: mosquitto with users and the topic ACL of docs/security.md
- ``chat_terminal``: the chat client (``python -m worker.chat``) in a pseudo-terminal
- ``layout``: docs/architecture.md's layout table from the docstrings (``python -m devtools.layout --write``)
- ``waiting``: ``eventually`` (a test waits for an event, never for a while) and ``PATIENCE``,
  how long a wait for one may take on a busy machine
- ``warmup_check``: a worker's warm-up logs no ERROR line and does every step
  (``python -m devtools.warmup_check MODEL``)
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

"""The worker as a process on its host.

- ``logs.py``: loguru set-up, for the worker and vLLM's processes
- ``children.py``: engine processes that die with the worker
- ``notify.py``: systemd's notify protocol (READY, STATUS, STOPPING, WATCHDOG)
- ``progress.py``: start phases with a heartbeat line while a long one runs
- ``metrics.py``: the Prometheus endpoint (stats.metrics_port)
"""

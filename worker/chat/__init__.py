"""The terminal chat client (``mqtt-vllm-chat``, ``python -m worker.chat``), a program of its own.

It speaks the worker's protocol (worker/protocol) over MQTT.

- ``cli.py``: options, settings and the program's entry point
- ``client.py``: the MQTT side (paho): connects, sends, turns what arrives into events
- ``terminal.py``: the interactive loop: prompt, streaming output, commands, tool rounds
- ``tool_calling.py``: tools from a JSON file, and answering calls without a person
"""

"""The broker connection.

- ``port.py``: the Transport contract, InboundMessage and the typed publish failures (no paho)
- ``mqtt.py``: the paho-mqtt adapter (MQTT v5), and the broker check before a start
"""

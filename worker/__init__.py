"""The worker, an MQTT chat inference server on vLLM (``python -m worker``, ``mqtt-vllm-worker``)."""

__version__ = "0.1.0"

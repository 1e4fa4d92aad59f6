"""MQTT chat inference worker on vLLM."""

__version__ = "0.1.0"

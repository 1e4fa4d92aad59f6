"""Vision: images in a conversation.

- ``images.py``: an image's bytes decoded to the pixels the engine takes, within bounds
  (format, pixels, truncation, decompression bombs); no I/O, run off the event loop.
- ``topics.py``: the latest image of the MQTT topics a session asks for (``imageTopics``).

The request's own images are parsed with the wire models (protocol/images.py).
"""

"""Vision: images in a conversation. topics.py reads the latest image of the MQTT topics a
session asks for (``imageTopics``); the request's own images are parsed with the wire models
(protocol/images.py)."""

"""Images for vision models.

- ``images.py``: an image's bytes decoded to the pixels the engine takes, within bounds
  (format, pixels, truncation, decompression bombs); no I/O, run off the event loop
"""

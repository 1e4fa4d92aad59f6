"""The worker's configuration.

- ``models.py``: the pydantic models, one per TOML section (the single source of truth)
- ``loader.py``: reading it: command line > environment > TOML file > defaults, and the
  generated config.example.toml and docs/configuration.md (``python -m worker.config.loader``)
"""

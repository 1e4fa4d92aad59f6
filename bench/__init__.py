"""The worker's benchmark: ``python -m bench --help``."""

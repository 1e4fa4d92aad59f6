"""Loaded by every Python process started with bench/gcprobe on PYTHONPATH (bench/gcpause.py)."""

from bench.gcpause import install_from_env

install_from_env()

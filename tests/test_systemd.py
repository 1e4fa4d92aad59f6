from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "mqtt-vllm-worker.service"


def unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


def test_unit_has_what_a_long_running_gpu_worker_needs() -> None:
    s = unit_settings()
    assert s["Restart"] == ["on-failure"]
    assert any("secrets.env" in v for v in s["EnvironmentFile"])
    assert int(s["TimeoutStopSec"][0]) > 60  # longer than drain_timeout's default
    env = " ".join(s["Environment"])
    for var in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert re.search(rf"{var}=/var/cache/mqtt-vllm-worker/", env), var
    assert s["CacheDirectory"] == ["mqtt-vllm-worker"]
    assert "python -m worker" in s["ExecStart"][0]
    # The worker speaks the notify protocol (notify.py): READY, start-timeout extensions, watchdog.
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert 0 < int(s["WatchdogSec"][0]) <= 120
    assert s["KillMode"] == ["control-group"]  # vLLM's engine processes go too
    for hardening in ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp", "DevicePolicy", "UMask"):
        assert hardening in s


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify checks that ExecStart exists: point it at this interpreter.
    unit = tmp_path / UNIT.name
    unit.write_text(re.sub(r"^ExecStart=\S+", f"ExecStart={sys.executable}", UNIT.read_text(), flags=re.M))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    problems = [line for line in result.stderr.splitlines() if UNIT.name in line]
    assert result.returncode == 0 and not problems, result.stderr
    security = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--threshold=40", str(unit)], capture_output=True, text=True
    )
    assert security.returncode == 0, security.stdout[-2000:]

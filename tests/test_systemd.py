from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

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


def systemd_analyze() -> str:
    """scripts/setup.sh installs it: CI must never skip the unit's checks."""
    found = shutil.which("systemd-analyze")
    assert found, "systemd-analyze is missing: run scripts/setup.sh (Debian package systemd)"
    return found


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify checks that ExecStart exists: point it at this interpreter.
    unit = tmp_path / UNIT.name
    unit.write_text(re.sub(r"^ExecStart=\S+", f"ExecStart={sys.executable}", UNIT.read_text(), flags=re.M))
    result = subprocess.run([systemd_analyze(), "verify", str(unit)], capture_output=True, text=True)
    problems = [line for line in result.stderr.splitlines() if UNIT.name in line]
    assert result.returncode == 0 and not problems, result.stderr


def test_the_units_exposure_is_at_most_4(tmp_path: Path) -> None:
    """systemd-analyze security rates the sandboxing from 0 (locked down) to 10; the issue
    asks for 4.0 or less (measured with systemd 252: 2.0; the settings the issue lists alone: 6.4)."""
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text())
    security = subprocess.run(
        [systemd_analyze(), "security", "--offline=true", "--threshold=40", str(unit)], capture_output=True, text=True
    )
    assert security.returncode == 0, security.stdout[-3000:] + security.stderr
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d)", security.stdout)
    assert match, security.stdout[-2000:]
    assert float(match.group(1)) <= 4.0, security.stdout[-3000:]
    # The settings the issue names are among what it saw.
    s = unit_settings()
    assert s["DynamicUser"] == ["yes"] and s["StateDirectory"] and s["CacheDirectory"]
    for key, value in [
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("DevicePolicy", "closed"),
        ("UMask", "0077"),
    ]:
        assert s[key] == [value], key
    assert s["RestrictAddressFamilies"] and s["SystemCallFilter"]
    assert any(device.startswith(("/dev/nvidia", "char-nvidia")) for device in s["DeviceAllow"])

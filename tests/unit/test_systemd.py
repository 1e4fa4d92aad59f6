from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from devtools.systemd import SYSTEMD, TEMPLATE, UNIT, unit_settings
from worker.config import loader
from worker.config.loader import load_config
from worker.config.models import WorkerConfig

BOTH = pytest.mark.parametrize("unit", [UNIT, TEMPLATE], ids=["single", "template"])


@BOTH
def test_unit_has_what_a_long_running_gpu_worker_needs(unit: Path) -> None:
    s = unit_settings(unit)
    instance = "/%i" if unit == TEMPLATE else ""
    assert s["Restart"] == ["on-failure"]
    assert any("secrets.env" in v for v in s["EnvironmentFile"])
    assert int(s["TimeoutStopSec"][0]) > 60  # longer than drain_timeout's default
    env = " ".join(s["Environment"])
    for var in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert re.search(rf"{var}=/var/cache/mqtt-vllm-worker{instance}/", env), var
    assert s["CacheDirectory"] == [f"mqtt-vllm-worker{instance}"]
    assert s["StateDirectory"] == [f"mqtt-vllm-worker{instance}"]
    assert s["WorkingDirectory"] == [f"/var/lib/mqtt-vllm-worker{instance}"]  # state_dir is relative to it
    assert "python -m worker" in s["ExecStart"][0]
    # The worker speaks the notify protocol (notify.py): READY, start-timeout extensions, watchdog.
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert 0 < int(s["WatchdogSec"][0]) <= 120
    # SIGTERM to the worker only (it stops the engine after the drain); the rest is SIGKILLed.
    assert s["KillMode"] == ["mixed"]
    for hardening in ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp", "DevicePolicy", "UMask"):
        assert hardening in s


def test_the_template_hardens_what_the_single_unit_hardens() -> None:
    """Every setting of the single unit is in the template with the same value, except what
    names the instance (directories, devices, description) and the per-instance env file."""
    single, template = unit_settings(UNIT), unit_settings(TEMPLATE)
    per_instance = {"Description", "ExecStart", "CacheDirectory", "StateDirectory", "WorkingDirectory", "Environment"}
    for key, values in single.items():
        if key == "EnvironmentFile":
            assert set(values) < set(template[key]), key
        elif key not in per_instance:
            assert template.get(key) == values, key
    assert [v.replace("/%i", "") for v in template["Environment"]] == single["Environment"]


def test_worker_toml_is_the_one_place_of_the_settings() -> None:
    """The example systemd/worker.toml is valid as it stands, and the single unit passes no flag
    that would override what the recipe says to edit there."""
    s = unit_settings(UNIT)
    assert shlex.split(s["ExecStart"][0])[1:] == ["-m", "worker"]
    assert "WORKER_CONFIG=/etc/mqtt-vllm-worker/worker.toml" in s["Environment"]
    config = WorkerConfig.model_validate(loader.tomllib.loads((SYSTEMD / "worker.toml").read_text()))
    assert config.engine.model and config.engine.visible_devices == "0" and config.mqtt.username


@pytest.mark.parametrize("instance", ["0", "1", "0,1"])
def test_each_instance_is_its_own_worker(instance: str) -> None:
    """The template's command line, with the instance name (%I) of a GPU or of a
    tensor-parallel pair, is what the worker accepts: its GPUs and its own worker id."""
    command = shlex.split(unit_settings(TEMPLATE)["ExecStart"][0].replace("%I", instance))
    assert command[1:3] == ["-m", "worker"]
    config, _ = load_config([*command[3:], "--model", "m"], environ={})
    assert config.engine.visible_devices == instance
    devices = instance.replace(",", "_")
    assert config.effective_worker_id.endswith(f"-gpu{devices}")


def systemd_analyze() -> str:
    """scripts/setup.sh installs it: CI must never skip the unit's checks."""
    found = shutil.which("systemd-analyze")
    assert found, "systemd-analyze is missing: run scripts/setup.sh (Debian package systemd)"
    return found


def instance_names(unit: Path) -> list[str]:
    """What systemd-analyze checks: the unit, or the template through instances of it (one
    GPU, and GPUs 0,1 as systemd-escape spells it)."""
    if unit != TEMPLATE:
        return [unit.name]
    return [unit.name.replace("@", f"@{i}") for i in ("0", "1", r"0\x2c1")]


@BOTH
def test_systemd_analyze_verify(unit: Path, tmp_path: Path) -> None:
    # verify checks that ExecStart exists: point it at this interpreter.
    copy = tmp_path / unit.name
    copy.write_text(re.sub(r"^ExecStart=\S+", f"ExecStart={sys.executable}", unit.read_text(), flags=re.M))
    for name in instance_names(unit):
        result = subprocess.run([systemd_analyze(), "verify", str(tmp_path / name)], capture_output=True, text=True)
        problems = [line for line in result.stderr.splitlines() if unit.name in line or name in line]
        assert result.returncode == 0 and not problems, result.stderr


@BOTH
def test_the_units_exposure_is_at_most_4(unit: Path, tmp_path: Path) -> None:
    """systemd-analyze security rates the sandboxing from 0 (locked down) to 10; at most 4.0
    is accepted (measured with systemd 252: 2.0 for both units)."""
    (tmp_path / unit.name).write_text(unit.read_text())
    for name in instance_names(unit):
        security = subprocess.run(
            [systemd_analyze(), "security", "--offline=true", "--threshold=40", str(tmp_path / name)],
            capture_output=True,
            text=True,
        )
        assert security.returncode == 0, security.stdout[-3000:] + security.stderr
        match = re.search(r"Overall exposure level for \S+: (\d+\.\d)", security.stdout)
        assert match, security.stdout[-2000:]
        assert float(match.group(1)) <= 4.0, security.stdout[-3000:]
    # The basic settings are among what it saw.
    s = unit_settings(unit)
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

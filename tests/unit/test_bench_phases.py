"""The benchmark's --phases (python -m bench, bench.multigpu, bench.tools): a name that is no phase
(a typo) ends the command before anything starts, with the valid names; it is never skipped
as if it had run."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from bench import harness, multigpu, tools
from bench.common import phase_list


def test_an_unknown_phase_is_refused_with_the_valid_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as refused:
        harness.main(["--profile", "smoke", "--out", str(out), "--phases", "worker,inprocss"])
    assert refused.value.code == 2
    error = capsys.readouterr().err
    assert "unknown phase 'inprocss'" in error
    assert all(name in error for name in harness.PHASES)
    assert not out.exists(), "nothing starts: no output directory, no model, no broker"


@pytest.mark.parametrize(
    ("main", "args", "error"),
    [
        (multigpu.main, ["--phases", "single,pd"], "unknown phase 'pd'; the phases are: single, dp, tp"),
        (
            tools.main,
            ["--model", "m", "--phases", "prefix,forcd"],
            "unknown phase 'forcd'; the phases are: prefix, forced, round, parse",
        ),
    ],
)
def test_the_other_benchmarks_refuse_an_unknown_phase(
    main: Any, args: list[str], error: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["--out", str(tmp_path / "out"), *args])
    assert refused.value.code == 2
    assert error in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_phases_are_read_in_order_and_an_empty_list_is_refused() -> None:
    parse = phase_list(harness.PHASES)
    assert parse("restart, worker,") == ["restart", "worker"]
    with pytest.raises(Exception, match="no phase given"):
        parse(" , ")


def test_the_phases_the_command_describes_are_the_ones_it_runs() -> None:
    """The command's docstring describes each phase the dispatch knows, and no other."""
    assert harness.__doc__ is not None
    described = re.findall(r"^  (\w+) ", harness.__doc__, flags=re.M)
    assert described == list(harness.PHASES)

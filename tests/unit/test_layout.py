"""The layout's rules (docs/architecture.md), checked on the code as it is:

- third-party I/O (vLLM, torch, transformers, paho, Redis, Prometheus, SQLite, sockets) is
  imported only in the adapters named below, also inside functions;
- the core, the wire types, the configuration and the ports import none of it, not even
  indirectly (checked in a fresh interpreter);
- the shipped package imports nothing of what the wheel leaves out (devtools, tests, bench);
- no two worker modules import each other in a circle;
- the wheel ships every package of worker/ and nothing of devtools/, tests/ or bench/;
- docs/architecture.md's layout table is the one devtools/layout.py generates from the docstrings.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from devtools import layout

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "worker"

# The libraries that do I/O or carry an engine, and the only modules that may import each.
ADAPTERS: dict[str, set[str]] = {
    "vllm": {"worker/engine/vllm.py"},
    "torch": {"worker/prepare_model.py"},
    "transformers": {"worker/engine/tokenizer.py", "worker/prepare_model.py"},
    "tokenizers": set(),
    "huggingface_hub": {"worker/system/hub.py"},
    "gguf": set(),
    "paho": {"worker/transport/mqtt.py", "worker/chat/client.py"},
    "redis": {"worker/store/redis.py", "worker/intake/streams.py"},
    "prometheus_client": {"worker/system/metrics.py"},
    "sqlite3": {"worker/store/sqlite.py"},
    "ssl": {"worker/transport/mqtt.py"},
    # models.py: gethostname() for the default worker id, no connection
    "socket": {
        "worker/transport/mqtt.py",
        "worker/system/notify.py",
        "worker/web/__init__.py",
        "worker/config/models.py",
        "worker/engine/remote.py",  # the socket pair between the worker and its engine's process
    },
    "http": {"worker/web/__init__.py"},
    "urllib": {"worker/web/__init__.py"},
    "subprocess": {"worker/prepare_model.py", "worker/chat/tool_calling.py"},
    "ctypes": {"worker/system/children.py"},
    # Pillow: image decoding, its parsers kept to one module (worker/vision/images.py)
    "PIL": {"worker/vision/images.py"},
}
# Importable without any of the libraries above: the logic, the wire and the ports.
PURE = [
    "worker.core.service",
    "worker.core.turns",
    "worker.core.history",
    "worker.core.stats",
    "worker.core.ratelimit",
    "worker.protocol.messages",
    "worker.protocol.topics",
    "worker.protocol.packets",
    "worker.protocol.schemas",
    "worker.config.models",
    "worker.config.loader",
    "worker.engine.port",
    "worker.transport.port",
    "worker.store.port",
    "worker.core.session_cache",
    "worker.core.calls",
    "worker.session",
    "worker.schemacheck",
    "worker.store.memory",
    "worker.intake.group",
    "worker.protocol.images",
    "worker.vision.topics",
]
# What the pure modules must not load, even indirectly (the standard library's asyncio loads
# socket and ssl, pydantic loads urllib: those are not checked at run time).
HEAVY = sorted(set(ADAPTERS) - {"socket", "ssl", "http", "urllib", "subprocess", "ctypes"})
UNSHIPPED = ("devtools", "tests", "bench")


def imports_of(path: Path) -> set[str]:
    """Top-level names of the absolute imports anywhere in a module (functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def worker_modules() -> list[Path]:
    return sorted(WORKER.rglob("*.py"))


def test_io_libraries_are_imported_only_in_their_adapters() -> None:
    misplaced = {
        f"{path.relative_to(REPO).as_posix()} imports {library}"
        for path in worker_modules()
        for library in imports_of(path) & ADAPTERS.keys()
        if path.relative_to(REPO).as_posix() not in ADAPTERS[library]
    }
    assert not misplaced, f"only the adapters of ADAPTERS may: {sorted(misplaced)}"


def test_every_adapter_listed_still_imports_its_library() -> None:
    """A stale entry would let a new module import the library unseen under an old name."""
    stale = {
        f"{adapter} ({library})"
        for library, adapters in ADAPTERS.items()
        for adapter in adapters
        if library not in imports_of(REPO / adapter)
    }
    assert not stale


def test_the_core_the_wire_and_the_ports_load_without_io_libraries() -> None:
    """In a fresh interpreter, so that what they import indirectly counts too."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {PURE!r}: importlib.import_module(name)\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(result.stdout) == []


def test_the_shipped_package_imports_nothing_the_wheel_leaves_out() -> None:
    leaks = {
        f"{path.relative_to(REPO).as_posix()} imports {name}"
        for path in worker_modules()
        for name in imports_of(path) & set(UNSHIPPED)
    }
    assert not leaks


def test_the_layout_table_is_current() -> None:
    page = (REPO / layout.PAGE).read_text(encoding="utf-8")
    assert layout.page_with_table(page, layout.table()) == page, "regenerate: python -m devtools.layout --write"


def test_the_layout_table_names_every_module_and_package(tmp_path: Path) -> None:
    """A new module shows up as a row; one without a docstring is refused."""
    repo = tmp_path / "repo"
    for package in layout.PACKAGES:
        (repo / package).mkdir(parents=True)
        (repo / package / "__init__.py").write_text(f'"""The {package} package. More."""\n')
    (repo / "worker" / "core").mkdir()
    (repo / "worker" / "core" / "__init__.py").write_text('"""Core."""\n')
    (repo / "worker" / "core" / "new.py").write_text('"""A new module: it does X.\n\nDetails."""\n')
    (repo / "worker" / "__main__.py").write_text("")
    table = layout.table(repo)
    assert "| `worker/core/new.py` | A new module: it does X. |" in table
    assert "| `worker/core/` | Core. |" in table and "__main__" not in table
    (repo / "worker" / "core" / "bare.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="has no docstring"):
        layout.table(repo)


def test_the_docs_name_only_files_that_exist() -> None:
    """A file moved or renamed leaves no stale path in the README or docs/."""
    pages = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    path = re.compile(r"(?<![\w/.-])((?:worker|devtools|bench|tests|scripts)/[\w/]*\.(?:py|sh))\b")
    missing = {
        f"{page.relative_to(REPO)}: {match}"
        for page in pages
        for match in path.findall(page.read_text(encoding="utf-8"))
        if not (REPO / match).is_file()
    }
    assert not missing


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def worker_imports(path: Path) -> set[str]:
    """The worker modules a module imports (relative imports resolved; functions included)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            candidates = [target, *(f"{target}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found |= {c for c in candidates if c.startswith("worker") and c != name}
    return found


def test_the_worker_modules_import_each_other_without_a_circle() -> None:
    modules = {module_name(path): path for path in worker_modules()}
    graph = {name: {m for m in worker_imports(path) if m in modules} for name, path in modules.items()}
    graph = {name: targets - {name.rpartition(".")[0]} for name, targets in graph.items()}  # a package's face
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles


def test_the_wheel_ships_the_worker_and_nothing_of_development() -> None:
    """The packages setuptools finds with pyproject.toml's rule: every package of worker/ (the
    chat page's files included), none of devtools/, tests/ or bench/."""
    from setuptools import find_namespace_packages

    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    find = config["tool"]["setuptools"]["packages"]["find"]
    shipped = set(find_namespace_packages(where=str(REPO), include=find["include"]))
    wanted = {module_name(path) for path in worker_modules() if path.name == "__init__.py"}
    assert wanted <= shipped and "worker.web.static.vendor" in shipped
    assert not {name for name in shipped if name.split(".")[0] in UNSHIPPED}


def package_of(module: str) -> str:
    """worker.core.turns -> worker.core; a top-level module (worker.session) is its own unit."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_package_imports_one_that_depends_on_it() -> None:
    """Between packages (worker.core, worker.store, worker.engine, ...) imports point one way:
    the session's data types live in worker.session, which imports none of them, so the store
    and the engine adapters need not import the core that uses them."""
    modules = {module_name(path): path for path in worker_modules()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        source = package_of(name)
        targets = {package_of(m) for m in worker_imports(path) if m in modules or m.rpartition(".")[0] in modules}
        graph.setdefault(source, set()).update(t for t in targets if t not in (source, "worker"))
    order: list[str] = []
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph.get(name, ())):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2
        order.append(name)

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, circles
    assert "worker.core" not in graph["worker.store"] | graph["worker.engine"]


def test_test_files_have_unique_names_across_the_tiers() -> None:
    """pytest imports test modules by their basename (the tiers have no __init__.py): two
    files of one name stop the whole run at collection."""
    names = [path.name for path in (REPO / "tests").rglob("test_*.py")]
    assert sorted(name for name in set(names) if names.count(name) > 1) == []

"""The documentation's snippets and links, checked against the code (tests/README.md has the
convention for writers):

- Every ```sh and ```toml block of README.md, docs/*.md and tests/README.md is found by Sybil
  and checked:
  TOML is parsed and validated against the worker's config models (a snippet of one section
  validates as that section); shell passes ``bash -n``, every ``python -m MODULE`` exists and
  takes every ``--flag`` it is given (its ``--help`` lists it), the worker's flags and values
  validate as its configuration, every ``WORKER_`` variable and ``pip`` extra exists, and every
  path into the repository exists. A snippet made only of cheap commands (openssl, printf, cp,
  ``python -m worker --check-config``, ...) is also run, in a copy of the checkout with the tiny
  model standing in for the real one.
- ```sh illustrative and ```toml illustrative blocks are left out on purpose; every other block
  names its language, and no block is indented (markdown-it parses the pages), so no shell or
  TOML snippet escapes the checks unseen.
- Every relative link of README.md, docs/*.md, tests/README.md and bench/README.md leads to a
  file that exists, and its #anchor to a heading of that page.
- What the documentation states where users found it wrong: a cancel without requestId is
  answered without one.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from markdown_it import MarkdownIt
from sybil import Example, Sybil
from sybil.parsers.markdown import CodeBlockParser

from devtools.acl import documented_acl
from devtools.fakes import Harness
from devtools.waiting import PATIENCE
from worker.config import loader
from worker.config.models import WorkerConfig, env_for, flag_for, sections

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", REPO / "tests" / "README.md", *(REPO / "docs").glob("*.md")])
LINKED_PAGES = [*PAGES, REPO / "bench" / "README.md"]
# Languages a block may name besides the checked ones; "illustrative" after sh or toml exempts one.
CHECKED = ("sh", "toml")
OTHER_LANGUAGES = {"json", "js", "python", "text", "conf", "acl"}
ILLUSTRATIVE = {f"{language} illustrative" for language in CHECKED}
# Programs cheap and harmless enough to run a snippet made of them (in a scratch copy).
CHEAP_PROGRAMS = {"openssl", "printf", "echo", "cp", "mkdir", "cat", "ls", "chmod"}
CHEAP_WORKER_FLAGS = {"--check-config", "--help", "--version"}
# Paths into the repository that a snippet may name (they must exist).
REPO_PREFIXES = ("scripts/", "systemd/", "docs/", "worker/", "devtools/", "bench/", "tests/")
REPO_FILES = {"config.example.toml", "pyproject.toml"}
# The project's own entry points, as `python -m` would run them.
CONSOLE_SCRIPTS = {"mqtt-vllm-worker": "worker", "mqtt-vllm-chat": "worker.chat"}
OPERATORS = {"|", "||", "&&", ";", "&", "(", ")"}
REDIRECTIONS = re.compile(r"^(>|>>|<|>&|&>|<<<?)$")
FD_REDIRECTION = re.compile(r"(?<=\s)[0-9]+(?=[<>])")  # the 2 of 2>file: shlex makes it a word
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


# --- shell snippets -------------------------------------------------------------------------


def simple_commands(script: str) -> list[list[str]]:
    """The simple commands of a snippet as words (shlex, POSIX rules): continuation lines
    joined, comments dropped, split at pipes and lists, redirections and their targets left
    out. A quoted string may go on over several lines."""
    found: list[list[str]] = []
    pending = ""
    for line in script.replace("\\\n", " ").splitlines():
        pending += FD_REDIRECTION.sub(" ", line) + "\n"
        lexer = shlex.shlex(pending, posix=True, punctuation_chars=";&|()<>")
        lexer.whitespace_split = True
        try:
            tokens = list(lexer)
        except ValueError:  # "No closing quotation": the string goes on on the next line
            continue
        pending = ""
        current: list[str] = []
        redirected = False
        for token in tokens:
            if redirected:
                redirected = False
            elif token in OPERATORS:
                found.append(current)
                current = []
            elif REDIRECTIONS.match(token):
                redirected = True
            else:
                current.append(token)
        if current:
            found.append(current)
    assert not pending, f"an unclosed quotation: {pending!r}"
    return [command for command in found if command]


def program_and_args(command: list[str]) -> tuple[list[str], bool]:
    """The command without leading variable assignments and ``sudo``; True when sudo was there."""
    words, sudo = list(command), False
    while words and (ASSIGNMENT.match(words[0]) or words[0] == "sudo"):
        sudo = sudo or words[0] == "sudo"
        words.pop(0)
    return words, sudo


def python_module(words: list[str]) -> tuple[str, list[str]] | None:
    """(module, arguments) of ``python -m MODULE ...`` or one of the project's console scripts."""
    if words and Path(words[0]).name in CONSOLE_SCRIPTS:
        return CONSOLE_SCRIPTS[Path(words[0]).name], words[1:]
    if len(words) >= 3 and re.fullmatch(r"python(3(\.\d+)?)?", Path(words[0]).name) and words[1] == "-m":
        return words[2], words[3:]
    return None


@functools.cache
def help_text(module: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=os.environ | {"PYTHONPATH": str(REPO)},
        timeout=PATIENCE,
        check=False,
    )
    assert done.returncode == 0, f"python -m {module} --help failed:\n{done.stderr[-2000:]}"
    return done.stdout


def known_environment() -> set[str]:
    names = {"WORKER_CONFIG"}
    for section, fields in sections().items():
        names |= {env_for(flag_for(section, key, info)) for key, info in fields.items()}
    return names


def pyproject_extras() -> set[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return set(config["project"]["optional-dependencies"])


def check_worker_arguments(args: list[str]) -> str | None:
    """The worker's flags and values, validated as its configuration would be, except for the
    files on the user's machine they name (the model, the password file, --config)."""
    if {"--help", "--version"} & set(args):
        return None
    kept: list[str] = []
    words = iter(args)
    for word in words:
        if word == "--config":
            next(words, None)
        elif not word.startswith("--config="):
            kept.append(word)
    original = loader._check_usable
    loader._check_usable = lambda config, environ: None  # the user's files are not here
    try:
        loader.load_config(kept, environ={})
    except loader.ConfigError as exc:
        return f"python -m worker {shlex.join(args)}: {exc}"
    except SystemExit:  # argparse has printed why
        return f"python -m worker {shlex.join(args)}: not accepted by the worker's command line"
    finally:
        loader._check_usable = original
    return None


def shell_problems(script: str) -> list[str]:
    """What is wrong with a shell snippet, statically."""
    problems: list[str] = []
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, check=False)
    if syntax.returncode != 0:
        problems.append(f"bash -n: {syntax.stderr.strip()}")
    unknown_env = set(re.findall(r"\bWORKER_[A-Z0-9_]+", script)) - known_environment()
    problems += [f"no such environment variable: {name}" for name in sorted(unknown_env)]
    for command in simple_commands(script):
        words, _ = program_and_args(command)
        for word in words:
            path = word.split("=", 1)[-1]
            named = (path.startswith(REPO_PREFIXES) or path in REPO_FILES) and "$" not in path
            if named and not (REPO / path).exists():
                problems.append(f"{path} does not exist in the repository")
        if words and Path(words[0]).name == "pip" and "install" in words:
            for word in words:
                if re.match(r"mqtt-vllm-worker\b", word):
                    problems.append(
                        f"pip install {word}: the worker is not on PyPI (pip install -e '.[...]' in a clone)"
                    )
                extras = re.search(r"\[([\w,-]+)\]$", word)
                if extras and not set(extras.group(1).split(",")) <= pyproject_extras():
                    problems.append(f"pip install {word}: pyproject.toml has no such extra")
        module_call = python_module(words)
        if module_call is None:
            continue
        module, args = module_call
        args = [arg for arg in args if arg != "..."]  # "..." stands for arguments left out
        if module.split(".")[0] in ("worker", "devtools", "bench") and not (
            (REPO / module.replace(".", "/")).with_suffix(".py").is_file()
            or (REPO / module.replace(".", "/") / "__main__.py").is_file()
        ):
            problems.append(f"python -m {module}: no such module")
            continue
        options = args[: args.index("--")] if "--" in args else args
        flags = [arg.split("=", 1)[0] for arg in options if arg.startswith("--")]
        listed = help_text(module)
        problems += [
            f"python -m {module}: no flag {flag} in its --help"
            for flag in flags
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", listed)
        ]
        if module == "worker":
            problem = check_worker_arguments(args)
            if problem:
                problems.append(problem)
    return problems


def outside_checkout(word: str) -> bool:
    """A path on this machine outside the working directory (/etc/..., ~/...; not /tmp, and
    not a word that only starts with a slash, such as openssl's -subj /CN=name)."""
    if word.startswith("~"):
        return True
    top = word.split("/")[1] if word.startswith("/") else ""
    return bool(top) and top != "tmp" and Path("/", top).exists()


def is_cheap(script: str) -> bool:
    """Made only of commands that are quick and write nowhere but the working directory."""
    commands = simple_commands(script)
    if not commands:
        return False
    for command in commands:
        words, sudo = program_and_args(command)
        # A bare assignment (x=$(...)) may run anything in its substitution: not cheap.
        if not words or sudo or any(outside_checkout(word) for word in words[1:]):
            return False
        module_call = python_module(words)
        if module_call is not None:
            module, args = module_call
            if not (module.startswith("worker") and CHEAP_WORKER_FLAGS & set(args)):
                return False
        elif Path(words[0]).name not in CHEAP_PROGRAMS:
            return False
    return True


def scratch_checkout(base: Path, model: Path) -> Path:
    """A copy of the checkout to run snippets in: the repository's files linked, the
    interpreter as .venv, and the tiny model where the demo's real model would be."""
    root = base / "checkout"
    root.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in {".git", ".venv", ".cache", "state"} and not entry.name.startswith("."):
            (root / entry.name).symlink_to(entry)
    (root / ".venv").symlink_to(Path(sys.prefix))
    (root / ".cache" / "models").mkdir(parents=True)
    (root / ".cache" / "models" / "smollm2-135m-instruct").symlink_to(model)
    return root


def check_shell(example: Example) -> str | None:
    script = str(example.parsed)
    problems = shell_problems(script)
    if problems:
        return "\n".join(problems)
    if is_cheap(script):
        root = scratch_checkout(example.namespace["tmp_path"], example.namespace["tiny_model"])
        env = os.environ | {
            "PYTHONPATH": str(REPO),
            "PATH": f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        env = {name: value for name, value in env.items() if not name.startswith("WORKER_")}
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0:
            return f"the snippet failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        example.namespace["ran"] = True
    return None


# --- TOML snippets --------------------------------------------------------------------------


def check_toml(example: Example) -> str | None:
    data = tomllib.loads(str(example.parsed))
    WorkerConfig.model_validate(data)  # a ValidationError names the section and key
    return None


SYBIL = Sybil(parsers=[CodeBlockParser("sh", check_shell), CodeBlockParser("toml", check_toml)], path=str(REPO))


def snippets(pages: list[Path] = PAGES) -> Iterator[Example]:
    for page in pages:
        yield from SYBIL.parse(page)


SNIPPETS = {f"{Path(e.path).relative_to(REPO)}:{e.line}": e for e in snippets()}


@pytest.mark.parametrize("where", sorted(SNIPPETS))
def test_snippet(where: str, tmp_path: Path, tiny_model: Path) -> None:
    example = SNIPPETS[where]
    example.namespace.update(tmp_path=tmp_path, tiny_model=tiny_model)
    example.evaluate()


def test_the_cheap_snippets_are_the_ones_run() -> None:
    """The rule picks what it should: the test certificate recipe and a configuration's check
    are run; anything with sudo, a broker or a model to load is not."""
    cheap = {where for where, example in SNIPPETS.items() if is_cheap(str(example.parsed))}
    pages = {where.split(":")[0] for where in cheap}
    assert {"docs/security.md", "docs/operations.md"} <= pages, cheap
    assert not is_cheap("sudo cp systemd/worker.toml /etc/mqtt-vllm-worker/worker.toml")
    assert not is_cheap(".venv/bin/python -m worker --model .cache/models/x")
    assert not is_cheap("/usr/sbin/mosquitto 2> mosquitto.log & broker=$!")
    assert is_cheap(".venv/bin/python -m worker --model m --check-config")


# --- every block is seen --------------------------------------------------------------------

MARKDOWN = MarkdownIt("commonmark")


def code_blocks(page: Path) -> list[tuple[int, str, str]]:
    """(line, info string, kind) of every code block of a page, as CommonMark parses it."""
    tokens = MARKDOWN.parse(page.read_text(encoding="utf-8"))
    return [(t.map[0] + 1, t.info.strip(), t.type) for t in tokens if t.type in ("fence", "code_block") and t.map]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_code_block_names_its_language_and_every_shell_or_toml_block_is_checked(page: Path) -> None:
    blocks = code_blocks(page)
    indented = [line for line, _, kind in blocks if kind == "code_block"]
    assert not indented, f"indented code blocks at lines {indented}: fence them and name the language"
    allowed = {*CHECKED, *ILLUSTRATIVE, *OTHER_LANGUAGES}
    unnamed = [(line, info) for line, info, _ in blocks if info not in allowed]
    assert not unnamed, f"blocks without a known language (one of {sorted(allowed)}): {unnamed}"
    checked = {line for line, info, _ in blocks if info in CHECKED}
    seen = {e.line for e in snippets([page])}
    assert checked == seen, f"blocks Sybil does not check: {sorted(checked - seen)}"


def test_the_checks_fail_on_what_they_should(tmp_path: Path) -> None:
    """A wrong flag, a wrong value, an unknown variable, a missing file or extra, a bad TOML key
    fail; an illustrative block is skipped; an unnamed or indented block is reported."""
    assert shell_problems(".venv/bin/python -m worker --no-such-flag 1")
    assert shell_problems("python -m worker --model m --max-tokens many")
    assert shell_problems("python -m worker.chat --mesage hi")
    assert shell_problems("python -m worker.nothing --help")
    assert shell_problems("echo WORKER_NO_SUCH=1")
    assert shell_problems("bash scripts/no-such.sh")
    assert shell_problems('pip install -e ".[gpu,nosuch]"')
    assert shell_problems("pip install 'mqtt-vllm-worker[mcp]'")
    assert not shell_problems("pip install -e '.[mcp]'")
    assert not shell_problems('sudo WORKER_CONFIG=/etc/w.toml python -m worker --model "$M" ... --check-config')
    page = tmp_path / "page.md"
    page.write_text(
        "```toml\n[mqtt]\nhots = 1\n```\n\n```sh illustrative\npython -m worker --bogus\n```\n\n"
        "```\nmosquitto -d\n```\n\n    indented\n"
    )
    examples = list(SYBIL.parse(page))
    assert len(examples) == 1  # the TOML block; the illustrative one is not an example
    with pytest.raises(Exception, match="hots"):
        examples[0].evaluate()
    assert [(info, kind) for _, info, kind in code_blocks(page)] == [
        ("toml", "fence"),
        ("sh illustrative", "fence"),
        ("", "fence"),
        ("", "code_block"),
    ]


# --- links ----------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def anchors(page: Path) -> set[str]:
    tokens = MARKDOWN.parse(page.read_text(encoding="utf-8"))
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    found: set[str] = set()
    for heading in headings:
        text = re.sub(r"`([^`]*)`", r"\1", re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading))
        base, n = slug(text), 1
        while (candidate := base if n == 1 else f"{base}-{n - 1}") in found:
            n += 1
        found.add(candidate)
    return found


def links(page: Path) -> Iterator[str]:
    for token in MARKDOWN.parse(page.read_text(encoding="utf-8")):
        for child in token.children or []:
            target = child.attrs.get("href") if child.type == "link_open" else child.attrs.get("src")
            if isinstance(target, str):
                yield target


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_lead_to_files_and_headings_that_exist(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:, file:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert not broken


@pytest.mark.parametrize("page", [*LINKED_PAGES, *(REPO / "docs" / "benchmarks").glob("*.md")], ids=str)
def test_a_page_that_runs_devtools_or_bench_says_to_run_it_from_the_repository_root(page: Path) -> None:
    """``devtools/`` and ``bench/`` are not installed (pyproject.toml ships ``worker`` only):
    ``python -m devtools.…`` works from the repository's root only, which the page must say."""
    text = page.read_text()
    if re.search(r"python3? -m (devtools|bench)\b", text):
        assert "repository's root" in text, f"{page.relative_to(REPO)} runs devtools or bench and does not say where"


def test_no_install_line_names_a_package_that_is_not_on_pypi() -> None:
    """The worker is installed from a clone (``pip install -e '.[mcp]'``), in the docs and in
    the messages the worker prints."""
    files = [*LINKED_PAGES, *(REPO / "worker").rglob("*.py")]
    named = [
        str(f.relative_to(REPO)) for f in files if re.search(r"pip install ['\"]?mqtt-vllm-worker\[", f.read_text())
    ]
    assert not named, named


def test_every_worker_variable_the_docs_name_exists() -> None:
    named = {name for page in PAGES for name in re.findall(r"\bWORKER_[A-Z0-9_]*[A-Z0-9]", page.read_text())}
    assert named and not named - known_environment(), sorted(named - known_environment())


# --- what the documentation states ----------------------------------------------------------


def test_a_cancel_without_request_id_is_answered_without_one() -> None:
    """docs/protocol.md, Errors: requestId is absent in the error to a control that names no
    request (a cancel without requestId), not only for payloads that are not JSON."""

    async def scenario() -> list[dict[str, Any]]:
        h = Harness()
        h.transport.deliver("chat/u/s1/control", {"action": "cancel"})
        await h.run_until(lambda: h.transport.replies("s1"))
        return h.transport.replies("s1")

    replies = asyncio.run(scenario())
    assert len(replies) == 1 and "requestId" not in replies[0], replies
    assert replies[0]["sessionId"] == "s1" and replies[0]["error"]["code"] == "invalid_request"


def test_the_service_settings_name_the_worker_id_the_documented_acl_grants() -> None:
    """systemd/worker.toml's worker_id line (commented out: the template unit must not share
    one), once uncommented, is the id whose status and stats docs/security.md's ACL grants."""
    text = (REPO / "systemd" / "worker.toml").read_text(encoding="utf-8")
    line = re.search(r"^# (worker_id = .*)$", text, re.M)
    assert line, "systemd/worker.toml: no commented worker_id line"
    uncommented = text.replace(line.group(0), line.group(1))
    config = WorkerConfig.model_validate(tomllib.loads(uncommented))
    worker_id = config.mqtt.worker_id
    acl = documented_acl()
    assert f"topic readwrite chat/_worker/{worker_id}/status" in acl
    assert f"topic readwrite chat/_worker/{worker_id}/stats" in acl

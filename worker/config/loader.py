"""Command line, environment and TOML, merged into one validated WorkerConfig.

Flags and environment variables are generated from the config models, so a new key gets
both for free. Errors name the key and where its value came from.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, get_args, get_origin

from pydantic import BaseModel, ValidationError

from .. import __version__
from .models import (
    MODEL_DEFAULTS_FILE,
    MqttConfig,
    WorkerConfig,
    env_for,
    field_is_model_default,
    field_is_secret,
    flag_for,
    sections,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


class ConfigError(Exception):
    """The configuration cannot be used; the message names the key and its source."""


def _kind(annotation: Any) -> str:
    """'bool', 'list', 'objects', 'dict' or 'scalar': how a flag or environment value is
    parsed. 'objects' is a list of tables ([[tools.mqtt]]): each flag value is one JSON object,
    a variable is a JSON array; 'dict' (a table, or a section's sub-table) is JSON."""
    candidates = [annotation, *get_args(annotation)]
    for candidate in candidates:
        origin = get_origin(candidate) or candidate
        if origin is bool:
            return "bool"
        if origin is list:
            items = get_args(candidate)
            if items and isinstance(items[0], type) and issubclass(items[0], BaseModel):
                return "objects"
            return "list"
        if origin is dict or (isinstance(origin, type) and issubclass(origin, BaseModel)):
            return "dict"
    return "scalar"


def did_you_mean(word: str, candidates: Iterable[str], quote: str = "'") -> str:
    """The ": did you mean 'x'?" of a mistyped ``word``: its closest candidate, or "" when none
    is close (difflib's ratio of at least 0.6: one or two letters off in a word of five)."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f": did you mean {quote}{close[0]}{quote}?" if close else ""


class SuggestingParser(argparse.ArgumentParser):
    """An ArgumentParser whose "unrecognized arguments" error names the closest flag of each
    (Python 3.14's ``suggest_on_error`` covers choices only). For the worker and its clients."""

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            flags = [option for option in self._option_string_actions if option.startswith("--")]
            hints = []
            for token in message[len(prefix) :].split():
                if token.startswith("--"):
                    hint = did_you_mean(token.split("=", 1)[0], flags, quote="")
                    if hint:
                        hints.append(f"{token.split('=', 1)[0]}{hint}")
            if hints:
                message += " (" + "; ".join(hints) + ")"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="python -m worker",
        description="MQTT chat inference worker on vLLM. Every option can also be set in the TOML "
        "file given by --config and by the environment variable WORKER_<FLAG>.",
    )
    parser.add_argument(
        "--config", type=Path, default=os.environ.get("WORKER_CONFIG"), help="TOML config file (env WORKER_CONFIG)."
    )
    parser.add_argument(
        "--check-config", action="store_true", help="Print the effective config (secrets masked) and exit."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    for section, fields in sections().items():
        group = parser.add_argument_group(f"[{section}]")
        for key, info in fields.items():
            flag = flag_for(section, key, info)
            dest = f"{section}.{key}"
            help_text = f"{info.description} (env {env_for(flag)})"
            kind = _kind(info.annotation)
            if kind == "bool":
                group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            elif kind in ("list", "objects"):
                group.add_argument(
                    flag,
                    dest=dest,
                    action="append",
                    default=None,
                    metavar="JSON" if kind == "objects" else "VALUE",
                    help=help_text + "; repeat the flag for several",
                )
            else:
                metavar = "JSON" if kind == "dict" else key.upper()
                group.add_argument(flag, dest=dest, default=None, metavar=metavar, help=help_text)
    return parser


def _set(tree: dict[str, Any], section: str, key: str, value: Any) -> None:
    tree.setdefault(section, {})[key] = value


def _parse_env_value(kind: str, raw: str, source: str) -> Any:
    if kind in ("list", "dict", "objects"):
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source}: not valid JSON ({exc.msg})") from None
        except ValueError:  # int() refuses an integer of over 4300 digits
            raise ConfigError(f"{source}: not usable JSON (an integer of over 4300 digits)") from None
        except RecursionError:  # json parses arrays and objects recursively
            raise ConfigError(f"{source}: not usable JSON (its arrays or objects nest too deep)") from None
    return raw


def _read_toml(path: Path) -> dict[str, Any]:
    """The tables of the TOML file given by --config; ConfigError when it cannot be read, is
    not UTF-8 (as TOML must be) or is not TOML this parser can take."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        # read_text decodes the whole file at once: exc.object is all of it.
        line = exc.object.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"config file {path} is not UTF-8, as TOML must be (line {line}: {exc.reason})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except ValueError:  # int() refuses an integer of over 4300 digits
        raise ConfigError(f"config file {path} is not usable TOML: an integer of over 4300 digits") from None
    except RecursionError:  # tomllib parses arrays and inline tables recursively
        raise ConfigError(f"config file {path} is not usable TOML: its arrays or inline tables nest too deep") from None


def load_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[WorkerConfig, argparse.Namespace]:
    """Parse flags, read the environment and the TOML file, validate the merged result."""
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    merged: dict[str, Any] = {}
    origin: dict[tuple[str, ...], str] = {}

    if args.config is not None:
        toml_data = _read_toml(Path(args.config))
        for section, values in toml_data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{args.config}: '{section}' must be a [section], one of {', '.join(sections())}")
            for key, value in values.items():
                _set(merged, section, key, value)
                origin[(section, key)] = f"in {args.config}"

    known_env = {"WORKER_CONFIG"}
    for section, fields in sections().items():
        for key, info in fields.items():
            flag = flag_for(section, key, info)
            env_name = env_for(flag)
            known_env.add(env_name)
            kind = _kind(info.annotation)
            if env_name in environ:
                _set(merged, section, key, _parse_env_value(kind, environ[env_name], env_name))
                origin[(section, key)] = f"from {env_name}"
            cli_value = getattr(args, f"{section}.{key}")
            if cli_value is not None:
                if kind == "dict":
                    cli_value = _parse_env_value(kind, cli_value, flag)
                elif kind == "objects":
                    cli_value = [_parse_env_value(kind, item, flag) for item in cli_value]
                _set(merged, section, key, cli_value)
                origin[(section, key)] = f"from {flag}"
    unknown_env = sorted(name for name in environ if name.startswith("WORKER_") and name not in known_env)
    if unknown_env:
        hint = did_you_mean(unknown_env[0], known_env, quote="")
        raise ConfigError(f"unknown environment variable {unknown_env[0]} (no such option){hint}")

    try:
        config = WorkerConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(describe(exc, origin)) from None
    _check_usable(config, environ)
    return config, args


@dataclass(frozen=True)
class Problem:
    """One problem of a validation error, with where its value came from."""

    name: str  # the field's dotted location ("mqtt.port"; "port" in a section's own model)
    source: str | None  # the flag, variable or file that gave the value
    message: str  # pydantic's message
    unknown: bool  # a key or section the models do not have (extra="forbid")


def problems(exc: ValidationError, origin: Mapping[tuple[str, ...], str]) -> list[Problem]:
    """The problems of a validation error; origin maps a field's location, (section, key) or
    (key,), to where its value came from. The worker and the chat client word them each their
    own way (describe, worker/chat/cli.py)."""
    found = []
    for error in exc.errors():
        loc = tuple(str(part) for part in error["loc"])
        source = (origin.get(loc[:2]) if len(loc) >= 2 else None) or (origin.get(loc[:1]) if loc else None)
        found.append(Problem(".".join(loc), source, error["msg"], error["type"] == "extra_forbidden"))
    return found


def describe(exc: ValidationError, origin: Mapping[tuple[str, ...], str]) -> str:
    """The worker's configuration error: every problem, on one line."""
    lines = []
    for problem in problems(exc, origin):
        name = problem.name or "config"
        where = f" ({problem.source})" if problem.source else ""
        if problem.unknown:
            kind = "section" if "." not in name else "key"
            lines.append(f"unknown {kind} '{name}'{where}{suggest_key(name)}")
        else:
            lines.append(f"invalid '{name}'{where}: {problem.message}")
    return "; ".join(lines)


def suggest_key(name: str) -> str:
    """The "did you mean" of an unknown section ("mqttt") or key ("engine.modle"): a close
    name in the same section, or the same key in the one section that has it ("engine.host":
    'mqtt.host')."""
    known = sections()
    if "." not in name:
        return did_you_mean(name, known)
    section, key = name.split(".", 1)
    elsewhere = [f"{other}.{key}" for other, fields in known.items() if key in fields]
    if len(elsewhere) == 1:
        return f": did you mean '{elsewhere[0]}'?"
    if section in known:
        return did_you_mean(name, [f"{section}.{other}" for other in known[section]])
    return did_you_mean(name, [f"{other}.{field}" for other, fields in known.items() for field in fields])


def _check_usable(config: WorkerConfig, environ: Mapping[str, str]) -> None:
    """Problems no single field can see: missing model, unreadable password or TLS files."""
    if not config.engine.model:
        raise ConfigError("no model: set --model, WORKER_MODEL or [engine] model")
    model = config.engine.model
    if Path(model).expanduser().exists():
        problem = model_dir_problem(Path(model).expanduser(), weights=config.engine.extra.get("load_format") != "dummy")
        if problem:
            raise ConfigError(f"engine.model: {model} {problem}")
    elif not is_hub_id(model):
        raise ConfigError(model_not_found(model, f"{Path(model).expanduser().absolute()} does not exist"))
    elif hub_offline(environ) and cached_hub_model(model, environ) is None:
        raise ConfigError(
            model_not_found(
                model,
                f"there is no directory {Path(model).absolute()}, the Hugging Face cache ({hub_cache(environ)}) "
                "does not have it, and downloads from the hub are off (HF_HUB_OFFLINE)",
                hub=True,
            )
        )
    check_connection_files(config.mqtt)
    if config.tools.mcp and importlib.util.find_spec("mcp") is None:
        servers = ", ".join(server.name for server in config.tools.mcp)
        raise ConfigError(
            f"tools.mcp names MCP servers ({servers}), but the MCP SDK is not installed: "
            "pip install -e '.[mcp]' in the worker's clone (or pip install 'mcp>=2.3,<3')"
        )


# A Hugging Face hub id: "name" or "org/name", as the hub spells them (letters, digits, "-",
# "_", "."; at most 96 each). Anything else that is not on disk can only be a mistyped path.
_HUB_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}", re.ASCII)


def is_hub_id(model: str) -> bool:
    return bool(_HUB_ID.fullmatch(model)) and ".." not in model and "--" not in model


def hub_offline(environ: Mapping[str, str]) -> bool:
    """Downloads are off (huggingface_hub's HF_HUB_OFFLINE, or transformers' TRANSFORMERS_OFFLINE)."""
    value = environ.get("HF_HUB_OFFLINE") or environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_cache(environ: Mapping[str, str]) -> Path:
    """Where huggingface_hub keeps downloaded models (its own order of variables)."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if environ.get(name):
            return Path(environ[name]).expanduser()
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]).expanduser() / "hub"
    base = Path(environ["XDG_CACHE_HOME"]) if environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base.expanduser() / "huggingface" / "hub"


def cached_hub_model(model: str, environ: Mapping[str, str]) -> Path | None:
    """The downloaded copy of hub model ``model`` in the Hugging Face cache (a snapshot with
    its config.json), or None."""
    snapshots = hub_cache(environ) / f"models--{model.replace('/', '--')}" / "snapshots"
    if not snapshots.is_dir():
        return None
    return next((snapshot for snapshot in sorted(snapshots.iterdir()) if (snapshot / "config.json").is_file()), None)


def model_not_found(model: str, why: str, *, hub: bool = False) -> str:
    """What the worker looked for, and what a user can do instead, for a --model it cannot
    find; ``hub``: ``model`` is a hub id (a download is one of the ways)."""
    ways = [
        "give --model a model directory on this machine (config.json, a tokenizer and weights, "
        "as the Hugging Face hub has them)",
        "prepare the demo model, SmolLM2-135M-Instruct, without the hub: python -m worker.prepare_model smollm2 "
        "(it prints the directory to give --model)",
    ]
    if hub:
        ways.append(f"download it where the hub can be reached: hf download {model} --local-dir DIR, then --model DIR")
    return f"engine.model: cannot find the model {model}: {why}. Either\n" + " or\n".join(f"  - {w}" for w in ways)


def check_connection_files(mqtt: MqttConfig, section: str = "mqtt.") -> None:
    """The password and TLS files can be read, and one password is set, not two: for the worker
    and for the chat client (whose flags are the worker's [mqtt] flags, without the section)."""
    if mqtt.password_file is not None:
        try:
            mqtt.password_value()
        except OSError as exc:
            raise ConfigError(f"{section}password_file: cannot read {mqtt.password_file}: {exc.strerror}") from None
        except UnicodeDecodeError:  # not its bytes: they may be the password
            raise ConfigError(f"{section}password_file: {mqtt.password_file} is not UTF-8") from None
    if mqtt.password is not None and mqtt.password_file is not None:
        raise ConfigError(f"{section}password and {section}password_file are both set: keep one")
    for key in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
        path = getattr(mqtt, key)
        if path is not None:
            try:
                path.read_bytes()
            except OSError as exc:
                raise ConfigError(f"{section}{key}: cannot read {path}: {exc.strerror}") from None


# What a model directory in the Hugging Face layout holds, as vLLM and transformers load it.
# Without this check a directory that is not a model fails minutes later, deep in
# transformers, with a 50-line traceback that blames an optional package (sentencepiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "tekken.json")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")


def model_dir_problem(path: Path, *, weights: bool = True) -> str | None:
    """What ``path`` lacks to be a model vLLM can load, in words; None when nothing is missing.
    A single .gguf file is a model too. ``weights``: False for load_format "dummy" (random
    weights of the config's shapes: the benchmarks' geometry models have none)."""
    if path.is_file():
        return None if path.suffix == ".gguf" else "is a file; --model takes a model directory (or a .gguf file)"
    if not path.is_dir():
        return "is not a directory"
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json (the model's architecture)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"a tokenizer ({', '.join(TOKENIZER_FILES[:3])} or similar)")
    if weights and not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or *.bin)")
    if not missing:
        return None
    listed = missing[0] if len(missing) == 1 else ", ".join(missing[:-1]) + " and " + missing[-1]
    return (
        f"is not a model directory: it lacks {listed}"
        + ". --model takes a directory in the Hugging Face layout, e.g. a downloaded model "
        "or one made by python -m devtools.tinymodel DIR"
    )


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items() if v is not None) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def render_toml(data: Mapping[str, Mapping[str, Any]], *, comments: bool) -> str:
    """The config as TOML; with comments, each key is preceded by its help, flag and env."""
    lines: list[str] = []
    fields = sections()
    for section, values in data.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            info = fields[section][key]
            if comments:
                flag = flag_for(section, key, info)
                lines.append(f"# {info.description}")
                lines.append(f"# flag {flag}, env {env_for(flag)}")
            if value is None and field_is_model_default(info):
                fallback = f"(unset: the model's {MODEL_DEFAULTS_FILE} value, else this)"
                lines.append(f"# {key} = {_toml_value(info.default)}   {fallback}")
            elif value is None:
                lines.append(f"# {key} =   (unset)")
            else:
                lines.append(f"{key} = {_toml_value(value)}")
            if comments:
                lines.append("")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def example_config() -> str:
    """The text of config.example.toml: every key with its default (a test keeps it in sync)."""
    defaults = WorkerConfig().model_dump(mode="json")
    for section, fields in sections().items():
        for key, info in fields.items():
            if field_is_secret(info) or field_is_model_default(info):
                defaults[section][key] = None
    header = (
        "# Worker configuration: every key with its default. Use it with --config FILE.\n"
        "# Precedence: command-line flag > environment variable > this file > default.\n"
        "# Your own configuration: copy this file (cp config.example.toml worker.toml) and change\n"
        "# what you need, or write a file with only the keys you set; the others keep their\n"
        "# defaults. Check it with --check-config (docs/operations.md). This file itself is\n"
        "# generated from the code by `python -m worker.config.loader --example-config` (a test\n"
        "# keeps it current): edit your copy, not this file.\n\n"
    )
    return header + render_toml(defaults, comments=True)


def reference_markdown() -> str:
    """The text of docs/configuration.md: one table per section (a test keeps it in sync)."""
    defaults = WorkerConfig().model_dump(mode="json")
    out = [
        "# Configuration reference",
        "",
        "Generated from the config models by `python -m worker.config.loader --reference`; do not edit by hand.",
        "Every key can be set in the TOML file (`--config FILE`), by its environment variable, or by its",
        "flag. Precedence: flag > environment > TOML > default. Unknown keys are an error.",
        "",
    ]
    for section, fields in sections().items():
        out += [f"## [{section}]", "", "| key | flag / environment | default | meaning |", "|---|---|---|---|"]
        for key, info in fields.items():
            flag = flag_for(section, key, info)
            default = defaults[section][key]
            shown = "(unset)" if default is None else f"`{_toml_value(default)}`"
            if field_is_model_default(info):
                shown = f"the model's, else {shown}"
            text = str(info.description).replace("|", "\\|")
            out.append(f"| `{key}` | `{flag}` `{env_for(flag)}` | {shown} | {text} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":  # pragma: no cover
    if sys.argv[1:] == ["--example-config"]:
        sys.stdout.write(example_config())
    elif sys.argv[1:] == ["--reference"]:
        sys.stdout.write(reference_markdown())
    else:
        sys.exit("usage: python -m worker.config.loader --example-config | --reference")

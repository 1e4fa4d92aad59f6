from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from devtools import REPO
from devtools.waiting import PATIENCE
from worker.chat.cli import main as chat_main
from worker.config.loader import ConfigError, example_config, load_config
from worker.config.models import WorkerConfig, default_worker_id, env_for, flag_for, sections
from worker.main import main
from worker.web.__main__ import main as web_main


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):  # what the start checks for
        (model / name).write_text("{}")
    return str(model)


def test_defaults(model_dir: str) -> None:
    config, _ = load_config(["--model", model_dir], environ={})
    assert config.generation.max_tokens == 256
    assert config.generation.max_tokens_limit == 1024
    assert config.history.max_history_turns == 6
    assert config.history.max_history_tokens == 2000
    assert config.mqtt.topic_prefix == "chat"
    assert config.engine.enforce_eager is False  # CUDA graphs on by default


def test_required_flag_names_exist() -> None:
    flags = {flag_for(s, k, info) for s, fields in sections().items() for k, info in fields.items()}
    required = {
        "--model",
        "--visible-devices",
        "--mqtt-host",
        "--mqtt-port",
        "--mqtt-username",
        "--mqtt-password-file",
        "--topic-prefix",
        "--worker-id",
        "--max-tokens",
        "--max-history-turns",
        "--max-history-tokens",
        "--stats-interval",
        "--gpu-memory-utilization",
        "--max-model-len",
        "--max-num-seqs",
        "--enforce-eager",
        "--block-size",
        "--engine-extra",
    }
    assert required <= flags
    assert len(flags) == sum(len(f) for f in sections().values()), "two keys share a flag"
    assert env_for("--mqtt-password") == "WORKER_MQTT_PASSWORD"


def test_precedence_cli_over_env_over_toml(tmp_path: Path, model_dir: str) -> None:
    toml = tmp_path / "w.toml"
    toml.write_text(
        f'[engine]\nmodel = "{model_dir}"\n[mqtt]\nport = 1000\nhost = "toml-host"\n[generation]\nmax_tokens = 100\n'
    )
    env = {"WORKER_MQTT_PORT": "2000", "WORKER_MAX_TOKENS": "200"}
    config, _ = load_config(["--config", str(toml), "--mqtt-port", "3000"], environ=env)
    assert config.mqtt.port == 3000  # CLI beats env and TOML
    assert config.generation.max_tokens == 200  # env beats TOML
    assert config.mqtt.host == "toml-host"  # TOML beats default
    assert config.history.max_history_turns == 6  # default


def test_typed_flags(model_dir: str) -> None:
    config, _ = load_config(
        [
            "--model",
            model_dir,
            "--enforce-eager",
            "--engine-extra",
            '{"max_num_batched_tokens": 4096}',
            "--stop",
            "END",
            "--stop",
            "STOP",
            "--stats-interval",
            "2.5",
        ],
        environ={"WORKER_BLOCK_SIZE": "32"},
    )
    assert config.engine.enforce_eager is True
    assert config.engine.extra == {"max_num_batched_tokens": 4096}
    assert config.generation.stop == ["END", "STOP"]
    assert config.engine.block_size == 32
    assert config.stats.interval == 2.5


def test_engine_limits_set_together_only_where_vllm_can_run_them(model_dir: str) -> None:
    """The token budget at or above the batch, or only one of them set: taken (the other is
    matched at start, engine/limits.py); engine.extra's values count as the flags' do."""
    for argv in (
        ["--max-num-seqs", "64", "--max-num-batched-tokens", "64"],
        ["--max-num-seqs", "4096"],
        ["--max-num-batched-tokens", "32"],
        ["--max-num-seqs", "64", "--engine-extra", '{"max_num_batched_tokens": 8192}'],
    ):
        load_config(["--model", model_dir, *argv], environ={})
    with pytest.raises(ConfigError, match=re.escape("max_num_batched_tokens (512) is below max_num_seqs (1024)")):
        load_config(
            ["--model", model_dir, "--engine-extra", '{"max_num_seqs": 1024, "max_num_batched_tokens": 512}'],
            environ={},
        )


def test_the_host_tiers_blocks_are_whole_gpu_blocks(model_dir: str) -> None:
    """kv_offload_block_tokens: 256 by default; set, a multiple of a set block_size (the
    field's or engine.extra's) or 0 (vLLM's: one GPU block), refused at load otherwise."""
    assert load_config(["--model", model_dir], environ={})[0].engine.kv_offload_block_tokens == 256
    for argv in (
        ["--block-size", "32"],
        ["--kv-offload-block-tokens", "0", "--block-size", "48"],
        ["--block-size", "48"],  # the default gives way at start (vLLM's unit), as before it existed
        ["--kv-offload-block-tokens", "96", "--engine-extra", '{"block_size": 48}'],
    ):
        load_config(["--model", model_dir, *argv], environ={})
    with pytest.raises(ConfigError, match=re.escape("kv_offload_block_tokens (256) is not a multiple of block_size")):
        load_config(
            ["--model", model_dir, "--kv-offload-block-tokens", "256", "--engine-extra", '{"block_size": 96}'],
            environ={},
        )
    with pytest.raises(ConfigError, match="from --kv-offload-block-tokens"):
        load_config(["--model", model_dir, "--kv-offload-block-tokens", "-16"], environ={})


@pytest.mark.parametrize(
    ("toml", "argv", "env", "message"),
    [
        (
            "",
            ["--block-size", "48", "--kv-offload-block-tokens", "256"],
            {},
            "kv_offload_block_tokens (256) is not a multiple of block_size (48)",
        ),
        ("[mqtt]\nhosst = 'x'\n", [], {}, "unknown key 'mqtt.hosst'"),
        ("[mqttt]\nhost = 'x'\n", [], {}, "unknown section 'mqttt'"),
        ("", ["--mqtt-port", "70000"], {}, "invalid 'mqtt.port' (from --mqtt-port)"),
        ("", [], {"WORKER_MAX_TOKENS": "lots"}, "invalid 'generation.max_tokens' (from WORKER_MAX_TOKENS)"),
        ("", [], {"WORKER_NO_SUCH": "1"}, "unknown environment variable WORKER_NO_SUCH"),
        ("", ["--max-tokens", "2000"], {}, "exceeds max_tokens_limit"),
        ("", ["--max-num-seqs", "64", "--max-num-batched-tokens", "32"], {}, "max_num_batched_tokens (32) is below"),
        ("[engine]\nextra = {max_num_batched_tokens = 100}\n", [], {"WORKER_MAX_NUM_SEQS": "128"}, "(128)"),
        ("", ["--topic-prefix", "chat/#"], {}, "invalid 'mqtt.topic_prefix'"),
        ("", ["--engine-extra", "{nope"], {}, "--engine-extra: not valid JSON"),
        ("[engine\n", [], {}, "is not valid TOML"),
    ],
)
def test_errors_name_the_key(
    tmp_path: Path, model_dir: str, toml: str, argv: list[str], env: dict[str, str], message: str
) -> None:
    path = tmp_path / "w.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(["--config", str(path), "--model", model_dir, *argv], environ=env)


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["--topic-prefix", "chat\n"], "mqtt.topic_prefix"),
        (["--worker-id", "gpu-1\n"], "mqtt.worker_id"),
        (["--share-group", "gpus\n"], "mqtt.share_group"),
        (["--tools-mqtt", '{"name": "lamp\\n", "topic": "devices/lamp", "users": ["*"]}'], "tools.mqtt.0.name"),
        (
            ["--tools-mcp", '{"name": "calc\\n", "url": "http://h/mcp", "allow": ["*"], "users": ["*"]}'],
            "tools.mcp.0.name",
        ),
        (["--vision-topics", '{"name": "door\\n", "topic": "cams/#", "users": ["*"]}'], "vision.topics.0.name"),
    ],
)
def test_a_name_with_a_trailing_newline_is_refused(model_dir: str, argv: list[str], key: str) -> None:
    """Names are checked with fullmatch: "^...$" with match took "gpu-1\n" ("$" matches before
    a final newline), and the newline reached topics and log lines."""
    with pytest.raises(ConfigError, match=re.escape(f"invalid '{key}' (from {argv[0]})")):
        load_config(["--model", model_dir, *argv], environ={})


@pytest.mark.parametrize(
    ("toml", "argv", "env", "message"),
    [
        (b'[mqtt]\nhost = "h\xff"\n', [], {}, "is not UTF-8, as TOML must be (line 2: invalid start byte)"),
        (
            b"[engine]\nextra = {a = " + b"[" * 5000 + b"]" * 5000 + b"}\n",
            [],
            {},
            "its arrays or inline tables nest too deep",
        ),
        (
            b"[engine]\nextra = {a = " + b"1" * 5000 + b"}\n",
            [],
            {},
            "is not usable TOML: an integer of over 4300 digits",
        ),
        (
            b"",
            ["--engine-extra", "[" * 5000 + "]" * 5000],
            {},
            "--engine-extra: not usable JSON (its arrays or objects nest",
        ),
        (
            b"",
            [],
            {"WORKER_MQTT_ALLOWED_RESPONSE_TOPICS": "[" * 5000 + "]" * 5000},
            "WORKER_MQTT_ALLOWED_RESPONSE_TOPICS: not usable JSON (its arrays or objects nest too deep)",
        ),
        (
            b"",
            [],
            {"WORKER_STOP": "[" + "1" * 5000 + "]"},
            "WORKER_STOP: not usable JSON (an integer of over 4300 digits)",
        ),
        (
            b"",
            ["--tools-mqtt", '{"name": "a", "topic": "t/x", "users": ["*"], "parameters": "' + "[" * 5000 + '"}'],
            {},
            "invalid 'tools.mqtt.0.parameters' (from --tools-mqtt): Value error, parameters is not usable JSON: its "
            "arrays or objects nest too deep",
        ),
    ],
    ids=[
        "toml-not-utf8",
        "toml-deep",
        "toml-huge-int",
        "flag-deep",
        "env-deep",
        "env-huge-int",
        "parameters-deep",
    ],
)
def test_input_not_utf8_or_nested_too_deep_is_a_configuration_error(
    tmp_path: Path, model_dir: str, toml: bytes, argv: list[str], env: dict[str, str], message: str
) -> None:
    """The worker says what is wrong and where, not a traceback (main catches ConfigError only:
    these were a UnicodeDecodeError, a RecursionError or a ValueError of int()), and without
    echoing the value."""
    path = tmp_path / "w.toml"
    path.write_bytes(toml)
    with pytest.raises(ConfigError, match=re.escape(message)) as exc:
        load_config(["--config", str(path), "--model", model_dir, *argv], environ=env)
    assert len(str(exc.value)) < 300, str(exc.value)


def test_a_password_file_that_is_not_utf8_is_a_configuration_error(
    tmp_path: Path, model_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Named, without its bytes (they may be the password): a UnicodeDecodeError before."""
    secret = tmp_path / "pw"
    secret.write_bytes(b"s3cret-\xff\xfe\n")
    with pytest.raises(ConfigError, match=re.escape(f"mqtt.password_file: {secret} is not UTF-8")) as exc:
        load_config(["--model", model_dir, "--mqtt-password-file", str(secret)], environ={})
    assert "s3cret" not in str(exc.value) and "xff" not in str(exc.value)
    assert main(["--model", model_dir, "--mqtt-password-file", str(secret), "--check-config"]) == 2
    assert "is not UTF-8" in capsys.readouterr().err


def test_engine_extra_nested_too_deep_is_a_configuration_error(
    model_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Past some 255 levels pydantic cannot serialize the config: --check-config (and the start's
    configuration log) ended in a ValueError traceback. The cap is far above what vLLM's engine
    arguments nest."""
    deep = '{"hf_overrides": ' + '{"a": ' * 300 + "1" + "}" * 301
    assert main(["--model", model_dir, "--engine-extra", deep, "--check-config"]) == 2
    err = capsys.readouterr().err
    assert "invalid 'engine.extra' (from --engine-extra): Value error, nests deeper than 32 levels" in err, err
    assert len(err) < 300, err
    nested = '{"hf_overrides": {"text_config": {"rope_scaling": {"factor": 2.0, "mrope_section": [16, 24]}}}}'
    config, _ = load_config(["--model", model_dir, "--engine-extra", nested], environ={})
    assert config.engine.extra["hf_overrides"]["text_config"]["rope_scaling"]["mrope_section"] == [16, 24]


def test_mistyped_keys_sections_variables_and_flags_get_a_did_you_mean(
    tmp_path: Path, model_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "w.toml"
    path.write_text("[engine]\nmodle = 'x'\nhost = 'y'\n[mqttt]\nport = 1\n[limits]\nzzz = 1\n")
    with pytest.raises(ConfigError) as exc:
        load_config(["--config", str(path), "--model", model_dir], environ={})
    text = str(exc.value)
    assert f"unknown key 'engine.modle' (in {path}): did you mean 'engine.model'?" in text, text
    assert "unknown key 'engine.host' (in " in text and "did you mean 'mqtt.host'?" in text, text  # another section's
    assert "unknown section 'mqttt': did you mean 'mqtt'?" in text, text
    assert f"unknown key 'limits.zzz' (in {path});" in text, text  # nothing close: no guess
    with pytest.raises(ConfigError, match=re.escape("WORKER_MODLE (no such option): did you mean WORKER_MODEL?")):
        load_config(["--model", model_dir], environ={"WORKER_MODLE": "x"})
    for tool, argv, hint in (
        (main, ["--model", model_dir, "--modle", "x"], "--modle: did you mean --model?"),
        (main, ["--model", model_dir, "--mqtt-hots=h"], "--mqtt-hots: did you mean --mqtt-host?"),
        (chat_main, ["--mesage", "hi"], "--mesage: did you mean --message?"),
        (web_main, ["--prot", "1"], "--prot: did you mean --port?"),
    ):
        with pytest.raises(SystemExit) as exit_:
            tool(argv)
        assert exit_.value.code == 2
        assert hint in capsys.readouterr().err


def test_engine_extra_keys_are_checked_against_vllms_engine_arguments(
    model_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--check-config looks each engine.extra key up in this vLLM's AsyncEngineArgs (read from
    its source), instead of vLLM refusing it 12 s into the engine start."""
    extra = '{"max_num_seq": 4, "enforce_eagre": true, "qqqzzz": 1, "kv_cache_memory_bytes": 268435456}'
    assert main(["--model", model_dir, "--engine-extra", extra, "--check-config"]) == 2
    err = capsys.readouterr().err
    assert "'max_num_seq' is not an engine argument of vLLM" in err and "did you mean 'max_num_seqs'?" in err, err
    assert "did you mean 'enforce_eager'?" in err and "'qqqzzz' is not an engine argument" in err, err
    assert "kv_cache_memory_bytes" not in err and "Traceback" not in err and "Triton" not in err, err
    assert main(["--model", model_dir, "--engine-extra", '{"kv_cache_memory_bytes": 1}', "--check-config"]) == 0


def test_checking_engine_extra_imports_neither_vllm_nor_torch(model_dir: str) -> None:
    """The names are read from vLLM's source (worker/engine/vllm_args.py): importing vLLM and
    torch for them made --check-config with an engine.extra typo take 58-63 s on 2 busy cores."""
    script = (
        "import sys; from worker.main import main; "
        f"code = main(['--model', {model_dir!r}, '--engine-extra', '{{\"max_num_seq\": 4}}', '--check-config']); "
        "print('imported:', sorted({'torch', 'vllm'} & set(sys.modules))); sys.exit(code)"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=PATIENCE)
    assert done.returncode == 2, done.stderr
    assert "imported: []" in done.stdout, done.stdout
    assert "'max_num_seq' is not an engine argument of vLLM 0." in done.stderr, done.stderr
    assert "did you mean 'max_num_seqs'?" in done.stderr, done.stderr


def test_missing_model_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no model"):
        load_config([], environ={})
    with pytest.raises(ConfigError, match="no/such/model does not exist"):
        load_config(["--model", "./no/such/model"], environ={})


def test_a_directory_that_is_not_a_model_is_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Said before anything loads, naming what is missing (not a transformers traceback)."""
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    (empty / "notes.txt").write_text("hello")
    assert main(["--model", str(empty)]) == 2
    err = capsys.readouterr().err
    assert f"engine.model: {empty} is not a model directory" in err, err
    assert "it lacks config.json (the model's architecture), a tokenizer (tokenizer.json" in err, err
    assert "and weights (*.safetensors or *.bin)" in err, err
    (empty / "config.json").write_text("{}")
    (empty / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"it lacks weights \(\*\.safetensors or \*\.bin\)\.") as exc:
        load_config(["--model", str(empty)], environ={})
    assert "config.json" not in str(exc.value) and "tokenizer" not in str(exc.value)
    # Random weights of the config's shapes (the benchmarks' geometry models) need none.
    load_config(["--model", str(empty), "--engine-extra", '{"load_format": "dummy"}'], environ={})
    (empty / "model.safetensors").write_text("{}")
    load_config(["--model", str(empty)], environ={})
    with pytest.raises(ConfigError, match="is a file"):
        load_config(["--model", str(empty / "notes.txt")], environ={})


def test_password_file_and_masking(tmp_path: Path, model_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret-value\n")
    config, _ = load_config(["--model", model_dir, "--mqtt-password-file", str(secret)], environ={})
    assert config.mqtt_password() == "s3cret-value"
    config, _ = load_config(["--model", model_dir], environ={"WORKER_MQTT_PASSWORD": "env-secret"})
    assert config.mqtt_password() == "env-secret"
    assert config.masked()["mqtt"]["password"] == "***"
    assert main(["--model", model_dir, "--check-config"]) == 0
    assert main(["--model", model_dir, "--mqtt-password", "cli-secret", "--check-config"]) == 0
    out = capsys.readouterr().out
    assert "cli-secret" not in out and 'password = "***"' in out


def test_check_config_exit_codes(model_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", model_dir, "--check-config", "--max-tokens", "5"]) == 0
    assert "max_tokens = 5" in capsys.readouterr().out
    assert main(["--model", model_dir, "--check-config", "--mqtt-port", "0"]) == 2
    assert "mqtt.port" in capsys.readouterr().err


def test_worker_id_default_differs_by_devices() -> None:
    assert default_worker_id("0") != default_worker_id("1")
    assert default_worker_id("0,1") != default_worker_id(None)
    assert re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", default_worker_id("2,3"))
    assert WorkerConfig().effective_worker_id == default_worker_id(None)


def test_a_worker_without_a_gpu_is_named_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_worker_id(None, gpu=False).endswith("-cpu")
    assert default_worker_id(None, gpu=True).endswith("-gpuall")
    assert default_worker_id("2", gpu=False).endswith("-gpu2")  # asked for: a warning at start says it is absent
    monkeypatch.setattr("worker.config.models.nvidia_gpu_present", lambda: False)
    assert WorkerConfig().effective_worker_id.endswith("-cpu")
    monkeypatch.setattr("worker.config.models.nvidia_gpu_present", lambda: True)
    assert WorkerConfig().effective_worker_id.endswith("-gpuall")


def test_example_config_is_current_and_loads(model_dir: str) -> None:
    text = (REPO / "config.example.toml").read_text()
    assert text == example_config(), "regenerate: python -m worker.config.loader --example-config > config.example.toml"
    for fields in sections().values():
        for key in fields:
            assert re.search(rf"^#? ?{key} =", text, re.M), key
    config, _ = load_config(["--config", str(REPO / "config.example.toml"), "--model", model_dir], environ={})
    assert config.model_dump(exclude={"engine": {"model"}}) == WorkerConfig().model_dump(exclude={"engine": {"model"}})


def test_configuration_reference_is_current() -> None:
    from worker.config.loader import reference_markdown

    text = (REPO / "docs" / "configuration.md").read_text()
    assert text == reference_markdown(), (
        "regenerate: python -m worker.config.loader --reference > docs/configuration.md"
    )


def test_command_line_password_warns(tmp_path: Path, model_dir: str) -> None:
    """The flag works but logs a warning (ps shows it); the environment and a file do not."""
    from loguru import logger

    from worker.main import warn_about_command_line_secrets

    secret = tmp_path / "pw"
    secret.write_text("file-secret\n")
    cases = [
        (["--mqtt-password", "cli-secret"], {}, True),
        ([], {"WORKER_MQTT_PASSWORD": "env-secret"}, False),
        (["--mqtt-password-file", str(secret)], {}, False),
    ]
    for argv, environ, warns in cases:
        lines: list[str] = []
        sink = logger.add(lines.append, level="WARNING", format="{message}")
        try:
            config, args = load_config(["--model", model_dir, *argv], environ=environ)
            warn_about_command_line_secrets(args)
        finally:
            logger.remove(sink)
        assert config.mqtt_password() in ("cli-secret", "env-secret", "file-secret")
        assert any("command line" in line for line in lines) == warns, (argv, lines)
        assert not any("secret" in line for line in lines)


def test_tls_options_are_validated(tmp_path: Path, model_dir: str) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("not checked here")
    with pytest.raises(ConfigError, match="tls_cert_file and tls_key_file go together"):
        load_config(["--model", model_dir, "--mqtt-tls-ca-file", str(pem), "--mqtt-tls-cert-file", str(pem)], {})
    with pytest.raises(ConfigError, match="need tls_ca_file"):
        load_config(["--model", model_dir, "--mqtt-tls-insecure-skip-hostname-check"], environ={})
    with pytest.raises(ConfigError, match=r"mqtt\.tls_ca_file: cannot read"):
        load_config(["--model", model_dir, "--mqtt-tls-ca-file", str(tmp_path / "missing.pem")], environ={})
    config, _ = load_config(
        ["--model", model_dir, "--mqtt-tls-ca-file", str(pem), "--mqtt-tls-cert-file", str(pem)],
        environ={"WORKER_MQTT_TLS_KEY_FILE": str(pem)},
    )
    assert config.mqtt.tls_key_file == pem and not config.mqtt.tls_insecure_skip_hostname_check

"""Chat with the worker from a terminal, over MQTT (``python -m worker.chat``, ``mqtt-vllm-chat``).

Interactive when stdin is a terminal: replies stream as they are generated; /help lists the
commands; Ctrl-C during a reply cancels it. One shot otherwise (``--message TEXT``, or the
message on stdin): prints the reply and exits with

    0 a reply; 1 an error reply (or a cancelled one, or a reasoning model's whose thinking
    budget ran out before it answered); 2 a usage or configuration error;
    3 no answer: no broker (within --connect-timeout), no worker online (the message is not
    sent), or no answer within --timeout; 130 interrupted.

Connection flags are the worker's (``--mqtt-host`` ...), their environment variables
``CHAT_`` + the flag (``CHAT_MQTT_PASSWORD``): a chat client has its own MQTT user.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from .. import __version__
from ..config.loader import ConfigError, SuggestingParser, check_connection_files, problems
from ..config.models import MqttConfig, flag_for, sections
from ..protocol.messages import REASONING_BUDGET
from ..protocol.topics import InvalidTopic, SessionAddress
from .client import (
    Answer,
    ChatClient,
    ClientSettings,
    ConnectFailed,
    Delta,
    Disconnected,
    Event,
    Failed,
    Ready,
    Refused,
)
from .terminal import Terminal, budget_note, usage_line

EXIT_OK, EXIT_ERROR_REPLY, EXIT_USAGE, EXIT_NO_ANSWER, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
# One-shot mode, before it sends: how long to wait for the broker (a local one takes
# milliseconds, a remote one with TLS well under a second), and then for the workers' retained
# status, which the broker sends right after it acknowledges the subscriptions. A message
# that no worker would answer is not sent: the client says so instead of waiting --timeout.
CONNECT_TIMEOUT = 3.0
STATUS_WAIT = 1.5
ENV_PREFIX = "CHAT_"
# The worker's connection settings that a client shares (same flags, its own environment).
CONNECTION_KEYS = (
    "host",
    "port",
    "username",
    "password",
    "password_file",
    "tls_ca_file",
    "tls_cert_file",
    "tls_key_file",
    "tls_insecure_skip_hostname_check",
    "topic_prefix",
    "keepalive",
)
HELP = {
    "username": "MQTT username of this chat client: a client user, never the worker's. Also the default --user.",
    "password": "MQTT password. Prefer --mqtt-password-file or CHAT_MQTT_PASSWORD: ps shows command lines.",
    "keepalive": "Keepalive interval in seconds.",
}


class UsageError(Exception):
    """Flags or environment that cannot be used; the message says which."""


def env_for(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="python -m worker.chat",
        description="Chat with the MQTT vLLM worker. Interactive on a terminal (/help lists the commands); "
        "with --message, or a message on stdin, prints one reply and exits (0 reply, 1 error reply, "
        "2 usage, 3 no answer within --timeout).",
    )
    parser.add_argument(
        "--user", help="User namespace (topic level after the prefix). Default: the MQTT username, or anon."
    )
    parser.add_argument("--session", help="Session id: the conversation to join or resume. Default: a fresh one.")
    parser.add_argument("--message", help="Send this one message, print the reply and exit.")
    parser.add_argument(
        "--show-stats", action="store_true", help="After each reply: tokens (cached), TTFT and latency (/verbose)."
    )
    parser.add_argument(
        "--show-reasoning",
        action="store_true",
        help="Show a reasoning model's thinking as it streams (/reasoning); in one-shot mode on stderr.",
    )
    parser.add_argument("--max-tokens", type=int, help="maxTokens of each request (default: the worker's).")
    parser.add_argument("--temperature", type=float, help="Sampling temperature (default: the worker's).")
    parser.add_argument("--system-prompt", help="The session's system prompt (sent with each request).")
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="Seconds without any word of an answer (reply, streamed text or a reasoning model's thinking) "
        "before giving up on it (default 120).",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=CONNECT_TIMEOUT,
        help="In one-shot mode, seconds to wait for the broker to take the connection "
        f"(default {CONNECT_TIMEOUT:g}; at most --timeout).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    group = parser.add_argument_group(
        "connection", "The worker's flags; each also from the environment as CHAT_ + the flag, e.g. CHAT_MQTT_HOST."
    )
    fields = sections()["mqtt"]
    for key in CONNECTION_KEYS:
        info = fields[key]
        flag = flag_for("mqtt", key, info)
        text = f"{HELP.get(key, info.description)} (env {env_for(flag)})"
        if key == "tls_insecure_skip_hostname_check":
            group.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            group.add_argument(flag, dest=key, default=None, metavar=key.upper(), help=text)
    return parser


def load_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> ClientSettings:
    """Flags over CHAT_ environment variables over defaults, validated by the worker's own
    MqttConfig (topic prefix, TLS files that go together)."""
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    fields = sections()["mqtt"]
    for key in CONNECTION_KEYS:
        flag = flag_for("mqtt", key, fields[key])
        if env_for(flag) in environ:
            values[key], origin[key] = environ[env_for(flag)], env_for(flag)
        if getattr(args, key) is not None:
            values[key], origin[key] = getattr(args, key), flag
    try:
        config = MqttConfig.model_validate(values)
        check_connection_files(config, section="")
        password = config.password_value()
    except ValidationError as exc:
        found = problems(exc, {(key,): where for key, where in origin.items()})
        raise UsageError(
            "; ".join(
                f"{p.name or 'connection'}{f' ({p.source})' if p.source else ''}: "
                f"{p.message.removeprefix('Value error, ')}"
                for p in found
            )
        ) from None
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    return ClientSettings(
        host=config.host,
        port=config.port,
        username=config.username,
        password=password,
        topic_prefix=config.topic_prefix,
        keepalive=config.keepalive,
        tls_ca_file=config.tls_ca_file,
        tls_cert_file=config.tls_cert_file,
        tls_key_file=config.tls_key_file,
        tls_insecure_skip_hostname_check=config.tls_insecure_skip_hostname_check,
    )


def err(text: str) -> None:
    print(f"chat: {text}", file=sys.stderr, flush=True)


def wait_ready(client: ChatClient, timeout: float) -> str | None:
    """Until the broker acknowledged the subscriptions; else why not."""
    deadline = time.monotonic() + timeout
    problem = "no answer"
    while True:
        event = client.next_event(deadline - time.monotonic())
        if event is None:
            return f"no connection to the broker at {client.settings.host}:{client.settings.port} ({problem})"
        if isinstance(event, Ready):
            return None
        if isinstance(event, Refused):
            return event.reason
        if isinstance(event, ConnectFailed):
            problem = event.error


def wait_for_a_worker(client: ChatClient, timeout: float) -> bool:
    """Whether a worker's retained status says online, read as the broker sends them after
    the subscriptions are acknowledged (within ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not client.any_worker_online():
        if client.next_event(deadline - time.monotonic()) is None:
            return False
    return True


def one_shot(client: ChatClient, args: argparse.Namespace, message: str) -> int:
    """Send one message; print the reply on stdout (and its numbers on stderr with --show-stats)."""
    settings = client.settings
    try:  # checked before anything waits
        request = client.request(
            message,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            system_prompt=args.system_prompt,
            include_reasoning=True,  # its deltas say the worker is still at it (see --timeout)
        )
    except ValueError as exc:
        err(f"invalid request: {exc}")
        return EXIT_USAGE
    problem = wait_ready(client, min(args.timeout, args.connect_timeout))
    if problem is not None:
        err(f"{problem}; is the broker running there? (--mqtt-host, --mqtt-port)")
        return EXIT_NO_ANSWER
    if not wait_for_a_worker(client, min(args.timeout, STATUS_WAIT)):
        offline = sorted(client.workers_online)
        known = f" (offline: {', '.join(offline)})" if offline else ""
        err(
            f"no worker is online on {settings.host}:{settings.port}{known}: none of the workers' status "
            f"topics ({client.status_filter}) says online, so the message was not sent. "
            "Start a worker (python -m worker), or chat interactively, where requests wait for one"
        )
        return EXIT_NO_ANSWER
    client.publish(request)
    request_id = request.request_id
    assert request_id is not None  # client.request sets one
    sent = last_heard = time.monotonic()
    try:
        while True:
            event: Event | None = client.next_event(last_heard + args.timeout - time.monotonic())
            if event is None:
                client.cancel(request_id)  # a worker that gets it later need not generate it
                online = "" if client.any_worker_online() else " (no worker online)"
                err(f"no answer within {args.timeout:g} s{online}")
                return EXIT_NO_ANSWER
            if isinstance(event, Delta) and event.delta.request_id == request_id:
                last_heard = time.monotonic()
            elif isinstance(event, Disconnected):
                err(f"connection to the broker lost ({event.reason}); reconnecting")
            elif isinstance(event, Failed) and event.error.request_id in (request_id, None):
                err(f"error {event.error.error.code.value}: {event.error.error.message}")
                return EXIT_ERROR_REPLY
            elif isinstance(event, Answer) and event.reply.request_id == request_id:
                reply = event.reply
                if args.show_reasoning and reply.reasoning is not None:
                    print(f"[reasoning]\n{reply.reasoning}\n[answer]", file=sys.stderr, flush=True)
                print(reply.reply, flush=True)
                if args.show_stats:
                    print(f"[{usage_line(reply, (time.monotonic() - sent) * 1000)}]", file=sys.stderr, flush=True)
                if reply.finish_reason == "cancelled":
                    err("the reply was cancelled")
                    return EXIT_ERROR_REPLY
                if reply.finish_reason == REASONING_BUDGET:
                    err(budget_note(reply))
                    return EXIT_ERROR_REPLY
                return EXIT_OK
    except KeyboardInterrupt:
        client.cancel(request_id)
        return EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    environ = os.environ if environ is None else environ
    try:
        settings = load_settings(args, environ)
        user = args.user or settings.username or "anon"
        address = SessionAddress(user, args.session or f"chat-{uuid.uuid4().hex[:10]}")
    except UsageError as exc:
        err(str(exc))
        return EXIT_USAGE
    except InvalidTopic as exc:
        err(f"invalid --user or --session: {exc}")
        return EXIT_USAGE
    if args.password is not None:
        err("the MQTT password was given on the command line, where ps shows it: use --mqtt-password-file")
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `... | head` ends quietly
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="replace")  # a random model's text is not always printable
    interactive = args.message is None and sys.stdin.isatty()
    message = args.message
    if message is None and not interactive:
        message = sys.stdin.read().rstrip("\n")
    if message is not None and not message.strip():
        err("empty message")
        return EXIT_USAGE
    client = ChatClient(settings, address)
    client.start()
    try:
        if message is None:
            return Terminal(client, args).run()
        return one_shot(client, args, message)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())

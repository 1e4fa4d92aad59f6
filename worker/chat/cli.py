"""Chat with the worker from a terminal, over MQTT (``python -m worker.chat``, ``mqtt-vllm-chat``).

Interactive when stdin is a terminal: replies stream as they are generated; /help lists the
commands; Ctrl-C during a reply cancels it. One shot otherwise (``--message TEXT``, or the
message on stdin): prints the reply and exits with

    0 a reply; 1 an error reply (or a cancelled one, or a reasoning model's whose thinking
    budget ran out before it answered); 2 a usage or configuration error;
    3 no answer: no broker (within --connect-timeout), no worker online (the message is not
    sent), or no answer within --timeout; 4 the reply calls tools that nothing answers (the
    calls are printed on stdout, one JSON object a line); 130 interrupted.

Tools (``--tools FILE``) are kept by the session. A reply that calls tools is answered by
the user in the terminal, or without asking by ``--tool-result`` values and ``--tool-command``
(tool_calling.py); the model then goes on until it replies without calls.

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
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .. import __version__
from ..config.loader import ConfigError, SuggestingParser, check_connection_files, problems
from ..config.models import MqttConfig, flag_for, sections
from ..protocol.messages import REASONING_BUDGET, ChatReply
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
from .images import read_image
from .terminal import Terminal, budget_note, length_note, printable, usage_line
from .tool_calling import (
    Results,
    ToolCommand,
    ToolSettings,
    ToolSetupError,
    call_line,
    load_tools,
    result_line,
    tool_choice,
    tool_event_line,
    worker_call_line,
    worker_tools,
)

EXIT_OK, EXIT_ERROR_REPLY, EXIT_USAGE, EXIT_NO_ANSWER, EXIT_TOOL_CALLS, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130
# One-shot mode, before it sends: how long to wait for the broker (a local one takes
# milliseconds, a remote one with TLS well under a second), and then for the workers' retained
# status, which the broker sends right after it acknowledges the subscriptions. A message
# that no worker would answer is not sent: the client says so instead of waiting --timeout.
CONNECT_TIMEOUT = 3.0
STATUS_WAIT = 1.5
# One-shot mode's maxTokens when --max-tokens is not given: a one-line question's answer with
# room to spare (a line of text is about 20 tokens, two sentences 40-60). A model that repeats
# itself instead stops after 96 tokens, in seconds (the worker's default, 256 tokens of
# repetition, took 113 s on 2 CPU cores), and the note on stderr says the reply was cut.
# Interactive chats keep the worker's default: a person sees the reply as it streams and can
# cancel it.
ONE_SHOT_MAX_TOKENS = 96
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


TOOLS_EPILOG = """\
tool calling:
  A reply may ask the client to run tools (docs/protocol.md). The calls are shown with their
  arguments; the terminal asks for each call's result (an empty line sends an empty result,
  Ctrl-C leaves them unanswered), or --tool-result / --tool-command answer them. The results
  go back to the worker, the model goes on, and a message ends with a reply without calls.
  In one-shot mode the final reply goes to stdout, the calls and results to stderr; calls
  that nothing answers are printed on stdout as JSON (one a line) and the run exits with 4.
  In the terminal, --tool-command answers calls without asking; --tool-result is for runs
  without a terminal.

  python -m worker.chat --tools tools.json --message "What time is it?" --tool-result "12:30 CET"
  python -m worker.chat --tools tools.json --message "Weather in Paris?" --tool-command ./run-tool.sh
  python -m worker.chat --session s1 --tools tools.json --message "What time is it?"   # exit 4, prints the calls
  python -m worker.chat --session s1 --tool-result 'call_8f3a..._0=12:30 CET'          # answers them
"""


class UsageError(Exception):
    """Flags or environment that cannot be used; the message says which."""


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def tool_settings(args: argparse.Namespace) -> ToolSettings:
    """The tool flags, checked before anything is sent (UsageError says what is wrong)."""
    try:
        tools = load_tools(args.tools) if args.tools is not None else None
        chosen = worker_tools(args.worker_tools)
        return ToolSettings(
            tools=tools,
            choice=tool_choice(args.tool_choice, tools, chosen),
            worker_tools=chosen,
            results=Results.parse(args.tool_result),
            command=ToolCommand(args.tool_command) if args.tool_command is not None else None,
            max_rounds=args.max_tool_rounds,
        )
    except ToolSetupError as exc:
        raise UsageError(str(exc)) from None


def env_for(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="python -m worker.chat",
        description="Chat with the MQTT vLLM worker. Interactive on a terminal (/help lists the commands);\n"
        "with --message, or a message on stdin, prints one reply and exits (0 reply, 1 error reply,\n"
        "2 usage, 3 no answer within --timeout, 4 tool calls that nothing answered).",
        epilog=TOOLS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_chat_arguments(parser)
    add_tool_arguments(parser)
    add_connection_arguments(parser)
    return parser


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    """The conversation and its requests: who, which session, the message, sampling, waiting."""
    parser.add_argument(
        "--user", help="User namespace (topic level after the prefix). Default: the MQTT username, or anon."
    )
    parser.add_argument("--session", help="Session id: the conversation to join or resume. Default: a fresh one.")
    parser.add_argument("--message", help="Send this one message, print the reply and exit.")
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help="Send this image (JPEG, PNG, GIF, WebP or BMP) with the message (interactively: with the first); "
        "again for more. The model must have vision.",
    )
    parser.add_argument(
        "--show-stats", action="store_true", help="After each reply: tokens (cached), TTFT and latency (/verbose)."
    )
    parser.add_argument(
        "--show-reasoning",
        action="store_true",
        help="Show a reasoning model's thinking as it streams (/reasoning); in one-shot mode on stderr.",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        help=f"maxTokens of each request (default: {ONE_SHOT_MAX_TOKENS} with --message or stdin, for a one-line "
        "answer; interactively the worker's). A reply cut at it is said on stderr.",
    )
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


def add_tool_arguments(parser: argparse.ArgumentParser) -> None:
    """The "tool calling" group: tools to declare, the worker's tools to use, how calls are answered."""
    tools = parser.add_argument_group("tool calling", "The model asks the client to run tools; see the end.")
    tools.add_argument(
        "--tools",
        type=Path,
        metavar="FILE",
        help="Declare tools: FILE holds a JSON list of OpenAI function tools. Sent with the (first) message; "
        "the session keeps them. A file with [] clears them.",
    )
    tools.add_argument(
        "--tool-choice",
        metavar="CHOICE",
        help="auto (the default with tools), none, required (some tool must be called) or a tool's name "
        "(that tool must be called): for each message, or without --message for the results sent.",
    )
    tools.add_argument(
        "--worker-tools",
        metavar="NAMES",
        help="The worker's own tools this session may use (docs/tools.md): '*' for every one your namespace "
        "may use, or names separated by commas; '' clears. The worker runs their calls itself; they are "
        "shown as they start and end. Sent with the (first) message; the session keeps the choice.",
    )
    tools.add_argument(
        "--tool-result",
        action="append",
        default=[],
        metavar="[KEY=]TEXT",
        help="Answer tool calls without asking: TEXT answers any call; NAME=TEXT the calls of tool NAME; "
        "ID=TEXT the call with that id; =TEXT sends TEXT as it is. Repeatable; several for one key answer "
        "its calls in turn. Without --message: the results of the session's pending calls (ID=TEXT).",
    )
    tools.add_argument(
        "--tool-command",
        metavar="CMD",
        help="Answer tool calls by running CMD once per call: the call's arguments (JSON) on its stdin, "
        "TOOL_NAME and TOOL_CALL_ID in its environment, its stdout the result. After --tool-result NAME=/ID=.",
    )
    tools.add_argument(
        "--max-tool-rounds",
        type=positive_int,
        default=8,
        metavar="N",
        help="Tool rounds per message (default 8); the results of the last one ask for a text answer.",
    )


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """The "connection" group: the worker's own MQTT flags (CONNECTION_KEYS), each also from
    the environment as CHAT_ + the flag."""
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


def one_shot(
    client: ChatClient,
    args: argparse.Namespace,
    message: str | None,
    tools: ToolSettings,
    pending: list[tuple[str, str]] | None = None,
) -> int:
    """Send one message (or ``pending``: the results of the session's pending tool calls) and
    the results of the tool rounds it leads to; print the final reply on stdout (and each
    reply's numbers on stderr with --show-stats)."""
    common = request_options(args)
    try:  # checked before anything waits
        if message is not None:
            request = client.request(
                message,
                tools=tools.tools,
                tool_choice=tools.choice,
                worker_tools=tools.worker_tools,
                images=[data for _, data in getattr(args, "images", ())],
                **common,
            )
        else:
            request = client.request(
                tool_results=pending,
                tools=tools.tools,
                tool_choice=tools.choice,
                worker_tools=tools.worker_tools,
                **common,
            )
    except ValueError as exc:
        err(f"invalid request: {exc}")
        return EXIT_USAGE
    unreachable = check_reachable(client, args)
    if unreachable is not None:
        return unreachable
    client.publish(request)
    assert request.request_id is not None  # client.request sets one
    return follow_replies(client, args, tools, request.request_id, common)


def request_options(args: argparse.Namespace) -> dict[str, Any]:
    """What every request of a one-shot run carries, the first and each round's results."""
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "system_prompt": args.system_prompt,
        "include_reasoning": True,  # its deltas say the worker is still at it (see --timeout)
    }


def check_reachable(client: ChatClient, args: argparse.Namespace) -> int | None:
    """None when the broker took the connection and a worker is online; else, said on stderr,
    the exit status (a message that no worker would answer is not sent)."""
    settings = client.settings
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
    return None


def follow_replies(
    client: ChatClient, args: argparse.Namespace, tools: ToolSettings, request_id: str, common: dict[str, Any]
) -> int:
    """Wait for the reply to ``request_id``; answer its tool calls and wait for the next, until
    a reply without calls (printed on stdout), an error, or --timeout without a word."""
    rounds = 0
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
                if event.delta.tool_event is not None:  # the worker runs one of its own tools
                    print(f"[{printable(tool_event_line(event.delta.tool_event))}]", file=sys.stderr, flush=True)
            elif isinstance(event, Disconnected):
                err(f"connection to the broker lost ({event.reason}); reconnecting")
            elif isinstance(event, Failed) and event.error.request_id in (request_id, None):
                err(f"error {event.error.error.code.value}: {event.error.error.message}")
                return EXIT_ERROR_REPLY
            elif isinstance(event, Answer) and event.reply.request_id == request_id:
                reply = event.reply
                show_reply_notes(reply, args, time.monotonic() - sent)
                if not reply.tool_calls:
                    return final_reply(reply, args)
                rounds += 1
                results = answer_calls(reply, tools, args.timeout)
                if results is None:
                    return EXIT_TOOL_CALLS
                request_id = client.send(tool_results=results, tool_choice=tools.choice_after(rounds), **common)
                sent = last_heard = time.monotonic()
    except KeyboardInterrupt:
        client.cancel(request_id)
        return EXIT_INTERRUPTED


def show_reply_notes(reply: ChatReply, args: argparse.Namespace, took: float) -> None:
    """On stderr, before a reply's text or calls: its reasoning (--show-reasoning), the worker's
    own tool calls it made, its numbers (--show-stats)."""
    if args.show_reasoning and reply.reasoning is not None:
        print(f"[reasoning]\n{reply.reasoning}\n[answer]", file=sys.stderr, flush=True)
    for worker_call in reply.worker_calls or ():
        print(f"[{printable(worker_call_line(worker_call))}]", file=sys.stderr, flush=True)
    if args.show_stats:
        print(f"[{usage_line(reply, took * 1000)}]", file=sys.stderr, flush=True)


def final_reply(reply: ChatReply, args: argparse.Namespace) -> int:
    """Print the reply without calls on stdout, what a script's reader should know about it on
    stderr; the exit status."""
    if reply.tool_parse_error:
        err(f"the model wrote a tool call that was not taken: {reply.tool_parse_error}")
    print(reply.reply, flush=True)
    if reply.finish_reason == "length":  # a script's reader should know it is cut
        err(length_note(reply, args.max_tokens))
    if reply.finish_reason == "cancelled":
        err("the reply was cancelled")
        return EXIT_ERROR_REPLY
    if reply.finish_reason == REASONING_BUDGET:
        err(budget_note(reply))
        return EXIT_ERROR_REPLY
    return EXIT_OK


def answer_calls(reply: ChatReply, tools: ToolSettings, timeout: float) -> list[tuple[str, str]] | None:
    """The results of a reply's calls, each shown on stderr with its call; None when a call
    has no answer: then every call is printed on stdout (as JSON, one a line) for a later run
    to answer with --session and --tool-result ID=TEXT."""
    assert reply.tool_calls is not None
    if reply.reply.strip():
        print(printable(reply.reply), file=sys.stderr, flush=True)
    results: list[tuple[str, str]] = []
    for call in reply.tool_calls:
        print(f"[{printable(call_line(call))}]", file=sys.stderr, flush=True)
        # A worker tool's call that asks for confirmation is approved by a person: the
        # terminal asks (y/n); a one-shot run leaves it unanswered.
        text, problem = (None, None) if call.needs_confirmation else tools.answer(call, timeout)
        if problem is not None:
            err(problem)
        if text is None:
            for each in reply.tool_calls:
                print(each.model_dump_json(by_alias=True, exclude_none=True), flush=True)
            if call.needs_confirmation:
                err(
                    f"the worker asks for approval before it runs {call.function.name} ({call.id}): "
                    "approve it in the interactive terminal (y/n) or on the chat page"
                )
                return None
            unanswered = ", ".join(c.id for c in reply.tool_calls if c.function.name == call.function.name)
            err(
                f"the reply calls tools that no --tool-result or --tool-command answers ({call.function.name}: "
                f"{unanswered}); send their results with --session {reply.session_id} --tool-result ID=TEXT"
            )
            return None
        print(f"[{printable(result_line(call.id, text))}]", file=sys.stderr, flush=True)
        results.append((call.id, text))
    return results


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """The chat command (``python -m worker.chat``, ``mqtt-vllm-chat``). SIGPIPE is the
    default while it runs (``... | head`` ends it quietly) and given back after: called in
    another process, a test's, it must not leave that process to die of the next write to a
    closed pipe or socket (a full test run once ended so, exit code 141, minutes later)."""
    previous = signal.getsignal(signal.SIGPIPE)
    try:
        return _main(argv, environ)
    finally:
        signal.signal(signal.SIGPIPE, previous)


def _main(argv: Sequence[str] | None, environ: Mapping[str, str] | None) -> int:
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
    try:
        tools = tool_settings(args)
    except UsageError as exc:
        err(str(exc))
        return EXIT_USAGE
    # Results without a message answer the session's pending calls: one shot, on a terminal too.
    answering = args.message is None and bool(args.tool_result)
    interactive = args.message is None and not answering and sys.stdin.isatty()
    message = args.message
    if not interactive and args.max_tokens is None:
        args.max_tokens = ONE_SHOT_MAX_TOKENS
    if message is None and not interactive and not answering:
        message = sys.stdin.read().rstrip("\n")
    if message is not None and not message.strip() and not args.image:
        err("empty message")
        return EXIT_USAGE
    if args.image and answering:
        err("--image goes with a message, not with --tool-result")
        return EXIT_USAGE
    try:  # read and checked before anything is sent: (file name, bytes)
        args.images = [(path, read_image(path)) for path in args.image]
    except ValueError as exc:
        err(str(exc))
        return EXIT_USAGE
    pending = None
    if answering:
        if args.session is None:
            err("--tool-result without --message answers a session's pending calls: name it with --session")
            return EXIT_USAGE
        try:
            pending = tools.results.for_pending()
        except ToolSetupError as exc:
            err(str(exc))
            return EXIT_USAGE
    client = ChatClient(settings, address)
    client.start()
    try:
        if interactive:
            return Terminal(client, args, tools=tools).run()
        return one_shot(client, args, message, tools, pending)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())

"""Outside JSON Schemas (issue 30, points 2, 5 and 6): nothing is ever fetched, whatever the
schema names; a forced call's combined schema keeps every local reference pointing where it
pointed (``#``, ``#/properties/...``, ``#/$defs/...``, escaped and percent-encoded pointers,
anchors); a server's tool list with any text in it is offered (or left out) and rendered
into a prompt without an error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loguru import logger

from devtools.net import ConnectionRecorder
from worker.config.models import McpMqttConfig, McpServerConfig, MqttToolConfig
from worker.core.calls import check_calls, forced_call_schema, schema_violation
from worker.core.history import user_message
from worker.engine.port import ParsedTools, ToolCallFormat
from worker.engine.tokenizer import ChatTokenizer
from worker.protocol.messages import ErrorCode, RequestError, parse_chat_request
from worker.schemacheck import SchemaUnusable, check_parameters, check_schema, grammar_document, valid_text
from worker.session import ToolSpec
from worker.tools.mcp import McpServerTools
from worker.tools.mcp_mqtt import McpOverMqtt, _Server

# worker/engine/vllm.py's Hermes format (that module imports vLLM: too slow for this file).
HERMES = ToolCallFormat(
    open="<tool_call>\n", close="\n</tool_call>", arguments_key="arguments", markers=("<tool_call>",)
)


# -- nothing is fetched ------------------------------------------------------------------


@pytest.fixture
def recorder() -> Iterator[ConnectionRecorder]:
    server = ConnectionRecorder()
    yield server
    server.close()


def remote_schemas(url: str) -> list[dict[str, Any]]:
    """Arguments schemas that would make a fetching resolver connect to ``url``."""
    base = url.rsplit("/", 1)[0] + "/"
    return [
        {"type": "object", "properties": {"a": {"$ref": url}}, "required": ["a"]},
        {"type": "object", "$id": base, "properties": {"a": {"$ref": "other.json"}}, "required": ["a"]},
        {"type": "object", "properties": {"a": {"$ref": url + "#/$defs/x"}}, "required": ["a"]},
        {"type": "object", "properties": {"a": {"$id": url, "$ref": "#/nowhere"}}, "required": ["a"]},
        {"type": "object", "properties": {"a": {"$dynamicRef": url + "#meta"}}},
        {"type": "object", "properties": {"a": {"$recursiveRef": url}}},
    ]


def request(**fields: Any) -> bytes:
    return json.dumps({"message": "hi", **fields}).encode()


def test_no_entry_point_fetches_a_remote_reference(recorder: ConnectionRecorder) -> None:
    """Client tools, responseFormat, an MCP server's and an MCP-over-MQTT server's tools, a
    device tool's parameters, and a forced call's validation: each schema that refers to the
    recorder's URL is refused or left out, and the recorder never gets a connection."""
    server = _Server("home/lamp")
    bridge = McpOverMqtt(McpMqttConfig(server_filter="home/#", allow=["*"], users=["*"]), None, "w1")  # type: ignore[arg-type]
    mcp = McpServerTools(McpServerConfig(name="calc", command=["true"], allow=["*"], users=["*"]))
    for schema in remote_schemas(recorder.url()):
        tool = {"type": "function", "function": {"name": "t", "parameters": schema}}
        with pytest.raises(RequestError) as refused:
            parse_chat_request(request(tools=[tool]), "s", 1 << 20)
        assert refused.value.code == ErrorCode.INVALID_SCHEMA
        response_format = {"type": "json_schema", "schema": schema}
        with pytest.raises(RequestError) as refused:
            parse_chat_request(request(responseFormat=response_format, toolChoice="none"), "s", 1 << 20)
        assert refused.value.code == ErrorCode.INVALID_SCHEMA
        listed = [{"name": "t", "description": "d", "inputSchema": schema}]
        bridge._offer(server, listed)
        assert not server.tools
        mcp._offer(listed)
        assert not mcp.tools()
        with pytest.raises(ValueError, match="parameters"):
            MqttToolConfig(name="t", topic="devices/t", users=["*"], parameters=schema)
        # A tool that got past every check (say, a session stored before this version):
        # validating a forced call's arguments against it still fetches nothing.
        spec = ToolSpec("t", None, schema)
        parsed = ParsedTools("", (("t", json.dumps({"a": 1})),), markup=True)
        check_calls("", parsed, [spec], key="k", round_=0, validate_all=True)
        schema_violation({"a": 1}, schema)
    # An unknown $schema is no reference: the latest draft checks it, nothing is fetched.
    dialect = {"$schema": recorder.url(), "type": "object", "properties": {"a": {"type": "integer"}}}
    parse_chat_request(request(responseFormat={"type": "json_schema", "schema": dialect}), "s", 1 << 20)
    assert schema_violation({"a": "x"}, dialect) is not None
    assert recorder.connections == 0


def test_a_reference_that_does_not_resolve_is_refused_when_declared() -> None:
    for ref in ("#/nowhere", "#/properties/b", "#nosuchanchor", "#/$defs/a/properties/zz"):
        schema = {"type": "object", "$defs": {"a": {"type": "object"}}, "properties": {"a": {"$ref": ref}}}
        with pytest.raises(SchemaUnusable, match="does not resolve"):
            check_parameters(schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}},
        {"$ref": "#", "type": "object"},
        {"type": "object", "anyOf": [{"type": "object"}, {"$ref": "#"}]},
        {"type": "object", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}}},
    ],
)
def test_references_that_loop_in_place_are_refused(schema: dict[str, Any]) -> None:
    """A reference that comes back to where it started without going into the value would
    make any check (and any grammar) recurse without end."""
    with pytest.raises(SchemaUnusable, match="loop"):
        check_parameters(schema)


# -- forced calls for every local reference ----------------------------------------------

LEAF = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["v"]}
# Each form of local reference, with values that are valid and values that are not.
FORMS: dict[str, tuple[dict[str, Any], list[Any], list[Any]]] = {
    "root": (
        {
            "type": "object",
            "properties": {"v": {"type": "integer", "maximum": 9}, "next": {"$ref": "#"}},
            "required": ["v"],
            "additionalProperties": False,
        },
        [{"v": 1}, {"v": 1, "next": {"v": 2, "next": {"v": 3}}}],
        [{"v": 1, "next": {"name": "t", "arguments": {"v": 1}}}, {"v": 1, "next": {"v": "x"}}, {"v": 10}],
    ),
    "properties": (
        {
            "type": "object",
            "properties": {"a": {"type": "string", "maxLength": 3}, "b": {"$ref": "#/properties/a"}},
            "required": ["a", "b"],
        },
        [{"a": "x", "b": "yz"}],
        [{"a": "x", "b": 1}, {"a": "x", "b": "long"}],
    ),
    "defs": (
        {
            "type": "object",
            "$defs": {"leaf": LEAF, "pair": {"type": "array", "items": {"$ref": "#/$defs/leaf"}, "maxItems": 2}},
            "properties": {"p": {"$ref": "#/$defs/pair"}, "q": {"$ref": "#/$defs/pair/items"}},
            "required": ["p", "q"],
        },
        [{"p": [{"v": 1}], "q": {"v": 2}}],
        [{"p": [{"v": "x"}], "q": {"v": 2}}, {"p": [], "q": {}}],
    ),
    "definitions": (
        {
            "type": "object",
            "definitions": {"leaf": LEAF},
            "properties": {"p": {"$ref": "#/definitions/leaf"}},
            "required": ["p"],
        },
        [{"p": {"v": 0}}],
        [{"p": {"v": -1}}],
    ),
    "escaped": (
        {
            "type": "object",
            "properties": {
                "a/b": {"type": "integer"},
                "c~d": {"type": "boolean"},
                "e f": {"enum": ["x", "y"]},
                "r1": {"$ref": "#/properties/a~1b"},
                "r2": {"$ref": "#/properties/c~0d"},
                "r3": {"$ref": "#/properties/e%20f"},
            },
            "required": ["r1", "r2", "r3"],
            "additionalProperties": False,
        },
        [{"r1": 1, "r2": True, "r3": "x"}],
        [{"r1": "1", "r2": True, "r3": "x"}, {"r1": 1, "r2": 1, "r3": "x"}, {"r1": 1, "r2": True, "r3": "z"}],
    ),
    "anchor": (
        {
            "type": "object",
            "$defs": {"leaf": {"$anchor": "leaf", **LEAF}},
            "properties": {"p": {"$ref": "#leaf"}},
            "required": ["p"],
        },
        [{"p": {"v": 3}}],
        [{"p": {}}],
    ),
}


def call(name: str, arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_forced_call_schema_keeps_each_reference_form(form: str) -> None:
    """The combined schema of a forced call (the tool beside another, so that its schema is
    not the root) accepts exactly what the tool's own schema accepts, and the client's check
    of the same schema passes."""
    schema, good, bad = FORMS[form]
    check_parameters(schema)
    tools = [
        ToolSpec("other", None, {"type": "object", "properties": {"x": {"$ref": "#"}}}),
        ToolSpec("t", None, schema),
    ]
    combined = forced_call_schema(tools, HERMES)
    jsonschema.Draft202012Validator.check_schema(combined)
    validator = jsonschema.Draft202012Validator(combined)
    for value in good:
        jsonschema.validate(value, schema)
        assert validator.is_valid(call("t", value)), value
    for value in bad:
        assert not jsonschema.Draft202012Validator(schema).is_valid(value)
        assert not validator.is_valid(call("t", value)), value
    refs = [v for v in _values(combined, "$ref")]
    assert refs and all(r.startswith("#/$defs/") and "/" not in r[len("#/$defs/") :] for r in refs)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_grammar_backend_compiles_each_reference_form(form: str) -> None:
    """xgrammar (the worker's backend) compiles the combined schema and the rewritten
    responseFormat, and accepts the valid calls' JSON and refuses the invalid ones: with
    the refs as the tool wrote them it resolves neither ~0, ~1 nor %20 (measured, xgrammar
    0.2.8), and '#' or '#/properties/...' would point at the call, not the arguments."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    schema, good, bad = FORMS[form]
    grammar = xgr.Grammar.from_json_schema(json.dumps(forced_call_schema([ToolSpec("t", None, schema)], HERMES)))
    alone = xgr.Grammar.from_json_schema(json.dumps(grammar_document(schema)))
    for value in good:
        assert _is_grammar_accept_string(grammar, json.dumps(call("t", value))), value
        assert _is_grammar_accept_string(alone, json.dumps(value)), value
    for value in bad:
        assert not _is_grammar_accept_string(grammar, json.dumps(call("t", value))), value


def test_declared_property_refs_are_not_refused_as_a_forced_call() -> None:
    """The issue's case: '#/properties/x' was invalid_schema in a forced call although the same
    schema worked as a responseFormat. Declared and forced, it parses."""
    schema = FORMS["properties"][0]
    tool = {"type": "function", "function": {"name": "t", "parameters": schema}}
    parsed = parse_chat_request(request(tools=[tool], toolChoice="required"), "s", 1 << 20)
    assert parsed.tools is not None


def _values(node: Any, key: str) -> Iterator[Any]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from _values(v, key)
    elif isinstance(node, list):
        for item in node:
            yield from _values(item, key)


# -- any Unicode ---------------------------------------------------------------------------

tricky = st.sampled_from(
    ["a", " ", "\x00", "\n", "\x1b", '"', "\\", "é", "😀", "\ud800", "\udfff", "\ud83d", "<|im_end|>"]
)
any_text = st.text(st.characters(exclude_categories=()), max_size=20) | st.lists(tricky, max_size=8).map("".join)
leaf_schemas = st.fixed_dictionaries(
    {"type": st.sampled_from(["string", "integer", "boolean"])}, optional={"description": any_text, "title": any_text}
)
schemas = st.one_of(
    st.none(),
    any_text,
    st.fixed_dictionaries(
        {"type": st.just("object"), "properties": st.dictionaries(any_text, leaf_schemas, max_size=3)},
        optional={"description": any_text, "required": st.lists(any_text, max_size=2), "enum": st.lists(any_text)},
    ),
)
tool_items = st.fixed_dictionaries(
    {"name": any_text | st.sampled_from(["read", "set"])}, optional={"description": any_text, "inputSchema": schemas}
)


@pytest.fixture(scope="module")
def template(tokenizer: ChatTokenizer) -> ChatTokenizer:
    return tokenizer


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(listed=st.lists(tool_items, max_size=4))
def test_any_text_in_a_server_tool_list_is_offered_or_left_out_never_an_error(
    listed: list[dict[str, Any]], template: ChatTokenizer
) -> None:
    """Tool lists with any text in names, descriptions and schemas (lone surrogates, NUL,
    controls, control tokens) go through both providers' offer path, then into the chat
    template and the tokenizer, a forced call's grammar schema and the JSON the engine gets:
    nothing raises, and whatever is offered is valid Unicode."""
    server = _Server("home/x")
    bridge = McpOverMqtt(McpMqttConfig(server_filter="home/#", allow=["*"], users=["*"]), None, "w1")  # type: ignore[arg-type]
    mcp = McpServerTools(McpServerConfig(name="calc", command=["true"], allow=["*"], users=["*"]))
    handler = logger.add(lambda _: None, level="WARNING")
    try:
        bridge._offer(server, listed)
        mcp._offer(listed)
    finally:
        logger.remove(handler)
    offered = [tool for tool, _ in server.tools.values()] + list(mcp.tools())
    for tool in offered:
        text = json.dumps(tool.spec().template_form(), ensure_ascii=False)
        text.encode("utf-8")  # valid Unicode all through
    specs = [tool.spec() for tool in offered]
    tools = [spec.template_form() for spec in specs] or None
    template.render([user_message("hi")], add_generation_prompt=True, tools=tools)
    if specs:
        json.dumps(forced_call_schema(specs, HERMES), ensure_ascii=False).encode("utf-8")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=any_text, description=any_text, schema=schemas)
def test_any_text_in_a_client_tool_is_refused_or_rendered(
    name: str, description: str, schema: Any, template: ChatTokenizer
) -> None:
    """A client's tool with any text: refused with an error code (bad_json for a lone
    surrogate, invalid_request, invalid_schema), or declared and rendered."""
    tool: dict[str, Any] = {"type": "function", "function": {"name": name, "description": description}}
    if schema is not None:
        tool["function"]["parameters"] = schema
    try:
        parsed = parse_chat_request(request(tools=[tool]), "s", 1 << 20)
    except RequestError as exc:
        assert exc.code in (ErrorCode.BAD_JSON, ErrorCode.INVALID_REQUEST, ErrorCode.INVALID_SCHEMA)
        return
    assert parsed.tools is not None
    specs = [ToolSpec(t.function.name, t.function.description, t.function.parameters) for t in parsed.tools]
    template.render([user_message("hi")], add_generation_prompt=True, tools=[s.template_form() for s in specs])
    json.dumps(forced_call_schema(specs, HERMES), ensure_ascii=False).encode("utf-8")


def test_a_lone_surrogate_in_a_description_is_repaired_and_a_schema_with_one_left_out() -> None:
    server = _Server("home/x")
    bridge = McpOverMqtt(McpMqttConfig(server_filter="home/#", allow=["*"], users=["*"]), None, "w1")  # type: ignore[arg-type]
    bridge._offer(
        server,
        [
            {"name": "a", "description": "x\ud800y", "inputSchema": {"type": "object"}},
            {"name": "b", "inputSchema": {"type": "object", "properties": {"\udfff": {"type": "string"}}}},
            {"name": "c\ud800", "inputSchema": {"type": "object"}},
            # two lone surrogates side by side: a JSON text's "\ud800\udc00" would read back as
            # one character, but the listed schema holds them apart (left out, as the one above)
            {"name": "d", "inputSchema": {"type": "object", "properties": {"\ud800\udc00": {"type": "string"}}}},
            {"name": "e", "inputSchema": {"type": "object", "description": "\ud800\udc00"}},
        ],
    )
    assert {name: tool.description for name, (tool, _) in server.tools.items()} == {"home_x_a": "x\ufffdy"}
    assert valid_text("\ud83d\ude00") == "😀" and valid_text("a\ud800") == "a\ufffd"


def test_an_unusable_server_schema_is_warned_once_per_server_tool_and_schema() -> None:
    lines: list[str] = []
    handler = logger.add(lambda m: lines.append(str(m)), level="WARNING", format="{message}")
    try:
        server = _Server("home/x")
        bridge = McpOverMqtt(McpMqttConfig(server_filter="home/#", allow=["*"], users=["*"]), None, "w1")  # type: ignore[arg-type]
        secret = "SECRET-SCHEMA-TEXT"
        bad = {"name": "t", "inputSchema": {"type": "object", "properties": {secret: {"$ref": "http://x/y"}}}}
        for _ in range(3):
            bridge._offer(server, [bad, {"name": "ok", "inputSchema": {"type": "object"}}])
        assert list(server.tools) == ["home_x_ok"]
        changed = {**bad, "inputSchema": {"type": "objekt"}}
        bridge._offer(server, [changed])
    finally:
        logger.remove(handler)
    assert len(lines) == 2, lines
    assert all("home/x" in line and " t " in line and secret not in line for line in lines), lines
    assert "refers to another document" in lines[0] and "not a valid JSON Schema" in lines[1]


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "$id": "http://[bad"},
        {"$schema": "http://[bad", "type": "object"},
        {"$schema": 5, "type": "object"},
        {"type": "object", "properties": {"a": {"$ref": "#/%zz"}}},
    ],
)
def test_unreadable_identifiers_are_invalid_schema_not_internal_errors(schema: dict[str, Any]) -> None:
    with pytest.raises(RequestError) as refused:
        parse_chat_request(request(responseFormat={"type": "json_schema", "schema": schema}), "s", 1 << 20)
    assert refused.value.code == ErrorCode.INVALID_SCHEMA


SCHEMA_KEYS = ["$id", "$ref", "$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor"]
SCHEMA_KEYS += ["$schema", "$defs", "definitions", "properties", "items", "prefixItems", "allOf", "anyOf", "not"]
SCHEMA_KEYS += ["type", "id", "a"]
SCHEMA_VALUES: list[Any] = ["#", "#/", "#/properties", "#/properties/a", "#a", "http://[bad", "#%zz", "#/$defs/a"]
SCHEMA_VALUES += ["#/items/0", "a", "#/allOf/0", "#/allOf/x", "http://json-schema.org/draft-07/schema#"]
SCHEMA_VALUES += ["http://json-schema.org/draft-04/schema#", "https://json-schema.org/draft/2019-09/schema"]
SCHEMA_VALUES += ["urn:x", "object", 5, True, None]
schema_keys = st.sampled_from(SCHEMA_KEYS)
schema_like = st.dictionaries(
    schema_keys,
    st.recursive(
        st.sampled_from(SCHEMA_VALUES),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(schema_keys, inner, max_size=4),
        max_leaves=15,
    ),
    max_size=5,
)


@settings(max_examples=400, deadline=None)
@given(schema=schema_like)
def test_any_schema_is_refused_or_usable_all_through(schema: dict[str, Any]) -> None:
    """Schema-shaped JSON full of references, identifiers, anchors and dialects: refused with
    SchemaUnusable, or checked, validated against and rewritten for the grammar without an
    error (an exception here is an internal_error in the worker)."""
    try:
        check_schema(schema)
    except SchemaUnusable:
        return
    grammar_document(schema)
    schema_violation({"a": 1}, schema)
    forced_call_schema([ToolSpec("t", None, schema)], HERMES)


# -- patterns are matched in linear time -------------------------------------------------

# Nested quantifiers that Python's backtracking ``re`` takes 2^n steps on, for a text of n
# "a"s that does not match: at 60 of them, longer than the age of the universe.
CATASTROPHIC = "^(a+)+$"
NO_MATCH = "a" * 60 + "!"


@pytest.mark.timeout(60)
def test_a_pattern_in_a_strict_tool_is_matched_in_linear_time() -> None:
    """A call's arguments are checked against the tool's patterns (``pattern``,
    ``patternProperties``, and ``additionalProperties`` beside them) with RE2, on the event
    loop: a pattern that backtracks can no longer hold it."""
    schema = {
        "type": "object",
        "properties": {"x": {"type": "string", "pattern": CATASTROPHIC}},
        "patternProperties": {"^(b+)+$": {"type": "integer"}},
        "additionalProperties": False,
        "unevaluatedProperties": False,
    }
    check_parameters(schema)
    assert "does not match" in (schema_violation({"x": NO_MATCH}, schema) or "")
    assert schema_violation({"x": "aaa", "b" * 60 + "!": 1}, schema) is not None  # not a pattern property
    assert schema_violation({"x": "aaa", "bbb": 1}, schema) is None
    assert "$.bbb" in (schema_violation({"x": "aaa", "bbb": "q"}, schema) or "")
    assert schema_violation({"x": "a\ud800"}, schema) is not None  # a lone surrogate matched as U+FFFD
    spec = ToolSpec("t", None, schema, strict=True)
    parsed = ParsedTools("", (("t", json.dumps({"x": NO_MATCH})),), markup=True)
    checked = check_calls("", parsed, [spec], key="k", round_=0, validate_all=False)
    assert checked.error is not None and "break its parameters" in checked.error


def test_jsonschema_still_matches_patterns_where_the_worker_replaced_re() -> None:
    """The modules of jsonschema whose ``re`` the worker replaced still call it: a release
    that moved its matching elsewhere would fail here, not backtrack again in silence."""
    import inspect

    from worker import schemacheck

    for module in schemacheck.PATTERN_MODULES:
        assert module.re is schemacheck.LINEAR_RE, module.__name__
    sources = "".join(inspect.getsource(module) for module in schemacheck.PATTERN_MODULES)
    assert sources.count("re.search(") >= 4  # pattern, patternProperties, the two property lookups
    assert "re.compile(" not in sources and "re.match(" not in sources and "re.fullmatch(" not in sources


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=a)b"}}},
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "(a)\\1"}}},
        {"type": "object", "patternProperties": {"(?<!x)y": {}}},
    ],
)
def test_a_pattern_without_a_linear_time_match_is_refused_when_declared(schema: dict[str, Any]) -> None:
    with pytest.raises(RequestError) as caught:
        parse_chat_request(
            request(tools=[{"type": "function", "function": {"name": "t", "parameters": schema}}]), "s", 1 << 20
        )
    assert caught.value.code == ErrorCode.INVALID_SCHEMA and "cannot check" in caught.value.message
    with pytest.raises(SchemaUnusable, match="lookaround or backreferences"):
        check_schema(schema)
    with pytest.raises(ValueError, match="parameters"):
        MqttToolConfig(name="t", topic="devices/t", users=["*"], parameters=schema)


def test_a_pattern_in_a_value_is_not_a_pattern() -> None:
    """Only patterns where a schema goes are checked: the same text in a const is a value."""
    check_schema({"type": "object", "properties": {"c": {"const": {"pattern": "(?=x)"}}}})


def test_arguments_nested_past_the_decoders_depth_are_not_json() -> None:
    """A model can write "[[[[..." deeper than Python's JSON decoder goes (RecursionError, not
    ValueError): the call is refused as not valid JSON, a forced call's body left as written."""
    from worker.core.calls import escape_raw_controls

    deep = "[" * 100_000 + "]" * 100_000
    spec = ToolSpec("t", None, {"type": "object"})
    checked = check_calls(
        "", ParsedTools("", (("t", deep),), markup=True), [spec], key="k", round_=0, validate_all=True
    )
    assert checked.error is not None and "not valid JSON" in checked.error
    assert escape_raw_controls(deep) == deep

"""JSON Schemas that come from outside (a client's tool parameters and responseFormat, an MCP
server's input schemas, a device tool's configured parameters): checked, resolved without
ever fetching anything, and rewritten for the grammar backend. No I/O: the one reference
registry here refuses every document it does not hold, so a ``$ref`` to a URL is an error,
never a request from the worker's host.

- ``check_schema``: a schema the worker can use, or ``SchemaUnusable`` saying why (too deep or
  large, text that is not valid Unicode, a reference to another document or one that does not
  resolve, not a valid JSON Schema).
- ``validator``: a jsonschema validator on the refusing registry (a call's arguments).
- ``grammar_schema``: the same schema with each reference rewritten to a plain
  ``#/$defs/<name>`` (what every grammar backend resolves; xgrammar 0.2 resolves neither
  ``~0``/``~1`` nor percent escapes, and a forced call's combined schema moves each tool's
  schema off the root, where ``#`` and ``#/properties/...`` would point elsewhere).
- ``valid_text``: text with lone surrogates repaired, as it may enter a prompt.

Patterns (``pattern``, ``patternProperties``) are matched by RE2, in time linear in the text,
wherever jsonschema matches them in this process: Python's ``re`` backtracks, and a client's
strict tool with ``"pattern": "^(a+)+$"`` made the check of one call's arguments ("aaa...a!")
take a second at 24 characters and a day at 40, with the event loop held all along. A pattern
RE2 does not take (lookaround, backreferences: neither has a linear-time match) makes a schema
unusable, said when it is declared or offered.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import jsonschema._keywords
import jsonschema._legacy_keywords
import jsonschema._utils
import re2  # type: ignore[import-untyped]  # google-re2
import referencing
import referencing.exceptions
import referencing.jsonschema

# A schema's sanity caps, checked before it reaches the engine: nesting of objects and
# arrays, and JSON values in all (a payload's size is capped separately).
MAX_SCHEMA_DEPTH = 32
MAX_SCHEMA_NODES = 4096

REFERENCE_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")
# Keywords a grammar never needs once every reference is a plain #/$defs/<name>: identifiers
# and anchors (whose scopes would change what "#..." means under the combined schema's
# $defs), the dialect, and the definitions themselves (each one used is moved to the root).
_GRAMMAR_DROPS = frozenset(
    {"$id", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$schema", "$vocabulary", "$defs", "definitions"}
)


# Applicators that apply their subschemas to the value itself (not to its items or properties).
_IN_PLACE_LISTS = ("allOf", "anyOf", "oneOf")
_IN_PLACE_VALUES = ("not", "if", "then", "else")


class SchemaUnusable(ValueError):
    """A schema the worker cannot use. ``reason``: a short phrase that quotes nothing of the
    schema (for logs: "refers to another document"); ``message``: the details, for the client
    that sent it."""

    def __init__(self, reason: str, message: str | None = None) -> None:
        super().__init__(message or reason)
        self.reason = reason
        self.message = message or reason


class UncheckablePattern(ValueError):
    """A pattern that RE2 does not take: it cannot be matched in linear time."""


_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # RE2 would print each refused pattern (a client's text) to stderr


# Compiled patterns kept for the next check of the same schema. Each keeps its own match
# memory (RE2 bounds it at 8 MiB a pattern; 64 patterns of "^.{1,1000}$" searched through
# 5,000 characters took 10 MB), so the count kept is bounded well below what clients can name.
@functools.lru_cache(maxsize=128)
def linear_pattern(pattern: str) -> Any:
    """``pattern`` compiled by RE2 (UncheckablePattern: one it does not take, with RE2's words)."""
    try:
        return re2.compile(pattern, options=_RE2_OPTIONS)
    except re2.error as exc:
        detail = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise UncheckablePattern(detail[:200]) from None


class _LinearRe:
    """Stands in for the ``re`` module in jsonschema's keyword code (``pattern``,
    ``patternProperties``, and the property lookups of ``additionalProperties`` and
    ``unevaluatedProperties``, which all call ``re.search``): the search is RE2's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(re, name)

    @staticmethod
    def search(pattern: str, string: str, flags: int = 0) -> Any:
        if flags:  # jsonschema passes none; anything else is not a schema's pattern
            return re.search(pattern, string, flags)
        # RE2 takes UTF-8: a lone surrogate (JSON's "\ud800") is matched as U+FFFD.
        return linear_pattern(pattern).search(valid_text(string) if isinstance(string, str) else string)


LINEAR_RE = _LinearRe()
# The modules of jsonschema that match a schema's patterns (4.18 to 4.26); a test checks each
# still calls the module-level ``re`` that is replaced here.
PATTERN_MODULES = (jsonschema._keywords, jsonschema._legacy_keywords, jsonschema._utils)
for _module in PATTERN_MODULES:
    _module.re = LINEAR_RE


def _refuse(uri: str) -> referencing.Resource[Any]:
    """The registry's retrieval: nothing is fetched, a reference to any document the schema
    does not hold itself is unresolvable."""
    raise referencing.exceptions.NoSuchResource(ref=uri)  # type: ignore[call-arg]


# Every validator and resolver of an outside schema uses this registry (jsonschema adds the
# metaschemas it bundles). Its default registry would download remote references.
REGISTRY: referencing.Registry[Any] = referencing.Registry(retrieve=_refuse)  # type: ignore[call-arg]


def validator_class(schema: dict[str, Any]) -> Any:
    """The jsonschema validator class of the schema's ``$schema`` (the latest draft when it
    names none, or one jsonschema does not know)."""
    dialect = schema.get("$schema")
    if dialect is not None and not isinstance(dialect, str):
        raise SchemaUnusable("is not a valid JSON Schema", "schema is not a valid JSON Schema: $schema is not a string")
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)


def validator(schema: dict[str, Any]) -> Any:
    """A validator of ``schema`` that resolves references only within the schema itself: an
    unresolvable one raises ``referencing.exceptions.Unresolvable`` while validating."""
    cls = validator_class(schema)
    # The schema's own $ids and anchors registered up front: jsonschema would crawl the whole
    # schema again for each anchor reference it follows (quadratic in the references).
    resource = referencing.Resource.from_contents(schema, default_specification=referencing.jsonschema.DRAFT202012)
    registry = REGISTRY.with_resource(resource.id() or "", resource).crawl()
    return cls(schema, registry=registry)


def shape(schema: Any) -> tuple[int, int]:
    """(depth, values) of a JSON document: how deep objects and arrays nest, how many values.
    Stops counting once over a cap."""
    depth = values = 0
    level = [schema]
    while level:
        values += len(level)
        containers = [node for node in level if isinstance(node, (dict, list))]
        if not containers:
            break
        depth += 1
        if depth > MAX_SCHEMA_DEPTH or values > MAX_SCHEMA_NODES:
            break  # already over a cap: stop walking
        level = [child for node in containers for child in (node.values() if isinstance(node, dict) else node)]
    return depth, values


def _strings(node: Any) -> Iterator[str]:
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, str):
            yield current
        elif isinstance(current, dict):
            for key, value in current.items():
                if isinstance(key, str):
                    yield key
                stack.append(value)
        elif isinstance(current, list):
            stack.extend(current)


def is_valid_text(text: str) -> bool:
    """Whether ``text`` can be encoded as UTF-8: no lone surrogate (which JSON's "\\ud800"
    escape, or a server's bytes decoded with surrogateescape, can put into a str)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def valid_text(text: str) -> str:
    """``text`` as valid Unicode: a surrogate pair spelled as two code points joined, each lone
    surrogate replaced by U+FFFD. Other text (NUL, controls) is valid and stays as it is."""
    if is_valid_text(text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _non_local_reference(node: Any) -> str | None:
    """The first reference keyword in a schema whose value is not a local JSON pointer or
    anchor ("#..."): one that names another document, which would have to be fetched."""
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            for name in REFERENCE_KEYWORDS:
                value = current.get(name)
                # Not a string: a property named "$ref" (its value is a schema), or an invalid
                # reference that the metaschema check refuses.
                if isinstance(value, str) and not value.startswith("#"):
                    return name
            stack.extend(current.values())
        elif isinstance(current, list):
            stack.extend(current)
    return None


class _Graph:
    """A schema's subschemas (by identity) and where each reference leads, resolved on the
    refusing registry. Subschemas are found as the schema's dialect defines them (referencing's
    specifications), starting at the root and at every reference's target (which is used as a
    schema wherever it sits)."""

    def __init__(self, schema: dict[str, Any]) -> None:
        specification = referencing.jsonschema.specification_with(
            schema.get("$schema", ""), default=referencing.jsonschema.DRAFT202012
        )
        root = specification.create_resource(schema)
        self.positions: dict[int, Any] = {}  # id -> a subschema (kept: its id stays its own)
        self.placed: set[int] = {id(schema)}  # the subschemas that sit where a schema goes
        self.targets: dict[tuple[int, str], Any] = {}  # (id of a subschema, keyword) -> the target
        # Crawled once: every $id and anchor known up front (a lookup on an uncrawled registry
        # crawls the whole schema again, each time: 1300 "#anchor" refs took 60 s).
        uri = root.id() or ""
        registry = REGISTRY.with_resource(uri, root).crawl()
        stack: list[tuple[referencing.Resource[Any], Any]] = [(root, registry.resolver(base_uri=uri))]
        while stack:
            resource, resolver = stack.pop()
            contents = resource.contents
            if not isinstance(contents, dict) or id(contents) in self.positions:
                continue
            self.positions[id(contents)] = contents
            for keyword in REFERENCE_KEYWORDS:
                ref = contents.get(keyword)
                if not isinstance(ref, str):
                    continue
                try:
                    resolved = resolver.lookup(ref)
                except referencing.exceptions.Unresolvable as exc:
                    raise SchemaUnusable(
                        "has a reference that does not resolve",
                        f"schema has a {keyword} that does not resolve within the schema: {ref[:200]!r}",
                    ) from exc
                except (ValueError, TypeError, LookupError) as exc:  # a malformed pointer ("#/items/x")
                    raise SchemaUnusable(
                        "has a reference that does not resolve",
                        f"schema has a {keyword} that does not resolve within the schema: {ref[:200]!r}",
                    ) from exc
                self.targets[(id(contents), keyword)] = resolved.contents
                target = specification.create_resource(resolved.contents)
                stack.append((target, resolved.resolver.in_subresource(target)))
            for sub in resource.subresources():
                self.placed.add(id(sub.contents))
                stack.append((sub, resolver.in_subresource(sub)))
        if self._loops():
            raise SchemaUnusable(
                "has references that loop",
                "schema has references that loop: they lead back to where they start without going into "
                "the value (a $ref to itself, or through allOf/anyOf/oneOf/not/if), so no value could be checked",
            )

    def _in_place(self, node: dict[str, Any]) -> Iterator[Any]:
        """The subschemas that apply to the same value as ``node``: its references' targets and
        its in-place applicators. A loop of these never ends."""
        for keyword in REFERENCE_KEYWORDS:
            if (id(node), keyword) in self.targets:
                yield self.targets[(id(node), keyword)]
        for keyword in _IN_PLACE_LISTS:
            value = node.get(keyword)
            if isinstance(value, list):
                yield from value
        for keyword in _IN_PLACE_VALUES:
            if keyword in node:
                yield node[keyword]
        value = node.get("dependentSchemas")
        if isinstance(value, dict):
            yield from value.values()

    def _loops(self) -> bool:
        done: set[int] = set()
        for start in self.positions.values():
            if id(start) in done:
                continue
            path = {id(start)}
            stack: list[tuple[int, Iterator[Any]]] = [(id(start), self._in_place(start))]
            while stack:
                key, children = stack[-1]
                child = next(children, None)
                if child is None:
                    stack.pop()
                    path.discard(key)
                    done.add(key)
                    continue
                if not isinstance(child, dict) or id(child) in done:
                    continue
                if id(child) in path:
                    return True
                path.add(id(child))
                stack.append((id(child), self._in_place(child)))
        return False


def check_schema(schema: Any) -> None:
    """Refuse (SchemaUnusable) a schema the worker cannot use: not a JSON object, too deep
    (MAX_SCHEMA_DEPTH) or too large (MAX_SCHEMA_NODES), with text that is not valid Unicode,
    with a reference to another document (only local references, ``#/...`` or ``#anchor``:
    nothing is ever fetched) or one that does not resolve, or not a valid JSON Schema (checked
    against its ``$schema``'s metaschema, by default the latest draft)."""
    if not isinstance(schema, dict):
        raise SchemaUnusable("is not a JSON object", "schema must be a JSON object")
    depth, values = shape(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise SchemaUnusable("nests too deep", f"schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    if values > MAX_SCHEMA_NODES:
        raise SchemaUnusable("is too large", f"schema has more than {MAX_SCHEMA_NODES} values")
    if not all(is_valid_text(text) for text in _strings(schema)):
        raise SchemaUnusable("has text that is not valid Unicode", "schema has a string that is not valid Unicode")
    keyword = _non_local_reference(schema)
    if keyword is not None:
        raise SchemaUnusable(
            "refers to another document",
            f"schema has a {keyword} to another document; only local references (#/...) are allowed",
        )
    try:
        _check_against_metaschema_and_refs(schema)
    except SchemaUnusable:
        raise
    except Exception as exc:  # urllib on an "$id": "http://[x", an "id" that is not a string where a ref leads
        raise SchemaUnusable(
            "is not a valid JSON Schema",
            "schema is not a valid JSON Schema: an identifier or a reference cannot be read",
        ) from exc


def _check_against_metaschema_and_refs(schema: dict[str, Any]) -> None:
    cls = validator_class(schema)
    try:
        meta = cls(cls.META_SCHEMA, registry=REGISTRY, format_checker=cls.FORMAT_CHECKER)
        error = jsonschema.exceptions.best_match(meta.iter_errors(schema))
    except referencing.exceptions.Unresolvable as exc:  # a metaschema jsonschema lacks: not fetched
        raise SchemaUnusable("is not a valid JSON Schema", "schema's metaschema is not available") from exc
    if error is not None:
        where = error.json_path if error.json_path != "$" else "the top level"
        raise SchemaUnusable(
            "is not a valid JSON Schema", f"schema is not a valid JSON Schema at {where}: {error.message[:300]}"
        )
    graph = _Graph(schema)  # every reference resolves
    for node in graph.positions.values():
        patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns += [key for key in node["patternProperties"] if isinstance(key, str)]
        for pattern in patterns:
            try:
                linear_pattern(pattern)
            except UncheckablePattern as exc:
                raise SchemaUnusable(
                    "has a pattern that cannot be checked",
                    f"schema has a pattern the worker cannot check, {pattern[:100]!r} ({exc}): patterns are "
                    "matched in linear time (RE2), without lookaround or backreferences",
                ) from None


def check_parameters(schema: Any) -> None:
    """A tool's parameters: a usable schema (check_schema) that describes a JSON object."""
    check_schema(schema)
    if schema.get("type", "object") != "object":
        raise SchemaUnusable("does not describe a JSON object", "parameters must describe a JSON object (type object)")


def grammar_schema(schema: dict[str, Any], prefix: str = "d") -> tuple[dict[str, Any], dict[str, Any]]:
    """``(root, defs)``: the schema for a grammar backend, with every reference (``$ref``, and
    ``$dynamicRef``/``$recursiveRef`` taken statically) rewritten to ``#/$defs/<prefix><n>``
    and each referenced subschema in ``defs`` once, under that name. Put ``defs`` under the
    ``$defs`` of the document's root, wherever ``root`` goes in it (a forced call's combined
    schema). A subschema that is referenced is replaced where it sits by a reference to its
    definition: nothing is copied twice, a recursive schema stays recursive. The schema must
    have passed check_schema."""
    graph = _Graph(schema)
    names: dict[int, str] = {}
    defs: dict[str, Any] = {}
    queue: list[Any] = []

    def name_of(target: Any) -> str:
        key = id(target)
        if key not in names:
            names[key] = f"{prefix}{len(names)}"
            queue.append(target)
        return names[key]

    def reference(target: Any) -> dict[str, Any]:
        return {"$ref": f"#/$defs/{name_of(target)}"}

    def copy(node: Any) -> Any:
        """A value as it goes into the output where it sits: a referenced subschema there as
        its reference."""
        schema = isinstance(node, dict) and id(node) in graph.placed
        if schema and id(node) in target_ids:
            return reference(node)
        return body(node, schema)

    def body(node: Any, schema: bool) -> Any:
        if isinstance(node, list):
            return [copy(item) for item in node]
        if not isinstance(node, dict):
            return node
        if not schema:  # a value (const, enum, default) or a map of schemas (properties)
            return {key: copy(value) for key, value in node.items()}
        out: dict[str, Any] = {}
        refs: list[dict[str, Any]] = []
        for key, value in node.items():
            if key in REFERENCE_KEYWORDS and (id(node), key) in graph.targets:
                refs.append(reference(graph.targets[(id(node), key)]))
            elif key not in _GRAMMAR_DROPS:
                out[key] = copy(value)
        if refs:
            out["$ref"] = refs[0]["$ref"]
            if len(refs) > 1:
                out["allOf"] = [*out.get("allOf", []), *refs[1:]]
        return out

    target_ids = {id(target) for target in graph.targets.values()}
    root = copy(schema)
    while queue:
        target = queue.pop(0)
        defs[names[id(target)]] = body(target, True)
    return root, defs


def grammar_document(schema: dict[str, Any]) -> dict[str, Any]:
    """A whole schema (a responseFormat) for the grammar backend: grammar_schema's root with
    its definitions under the root's $defs."""
    root, defs = grammar_schema(schema)
    return {**root, "$defs": defs} if defs else root

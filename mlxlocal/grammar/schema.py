"""JSON Schema -> llguidance grammar, with the errors a client can act on.

A schema is checked twice before anything is generated:
1. against the JSON-Schema metaschema (its `$schema`, draft 2020-12 by default), so a typo
   such as `"type": "strin"` or `"minimum": "3"` is named with its path;
2. by llguidance's compiler, which refuses what it cannot enforce during decoding.

Supported (enforced token by token): type (incl. lists of types), properties, required,
additionalProperties, minProperties/maxProperties, items, prefixItems, minItems/maxItems,
enum, const, minimum/maximum, exclusiveMinimum/exclusiveMaximum, multipleOf, minLength/
maxLength, pattern (Rust regex syntax, no look-around), format (date-time, date, time,
email, uri, uuid, ...), anyOf, oneOf (as anyOf), allOf, $ref/$defs/definitions (local),
patternProperties; annotations (title, description, default, examples...) are ignored.
Refused (400 naming the keyword and where it is): not, if/then/else, dependentRequired,
dependentSchemas, uniqueItems, contains/minContains/maxContains, propertyNames,
unevaluatedProperties/unevaluatedItems, unknown formats, remote $ref, and schemas that can
match nothing (`false`, minimum > maximum, a required property that is forbidden).

Departures from JSON Schema (llguidance's): object properties come in the order the schema
lists them; a plain "number" has no bound on its digits (multipleOf, e.g. 0.25, bounds them),
nor a string without maxLength / pattern on its length.

Whitespace: compact JSON (`{"a":1,"b":[2,3]}`), no whitespace between tokens, so a model
cannot spend its whole budget on spaces and newlines. A schema may override this (and other
llguidance JSON options) with its own `"x-guidance": {...}` key.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from typing import TYPE_CHECKING, Any

import jsonschema
from jsonschema.validators import validator_for
from llguidance import LLMatcher

from mlxlocal.engine import Grammar
from mlxlocal.grammar.errors import GrammarError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # in the stub only

# A request's schema at most (a 400 naming the field beyond): OpenAI's structured outputs
# take 5,000 object properties in all.
MAX_SCHEMA_BYTES = 1 << 20
MAX_PROPERTIES = 5000

# llguidance JSON compile options applied before the schema's own "x-guidance".
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

# Keywords whose value is a subschema / a map of them / a list of them: where a refused
# keyword can sit (a property *named* "not" is not the keyword).
_SUBSCHEMA = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else",
              "contains", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LIST = ("anyOf", "allOf", "oneOf", "prefixItems")

_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")


def _subschemas(schema: dict, path: str):
    for key in _SUBSCHEMA:
        if isinstance(schema.get(key), (dict, bool)):
            yield schema[key], f"{path}/{key}"
    for key in _SCHEMA_MAP:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield sub, f"{path}/{key}/{name}"
    for key in _SCHEMA_LIST:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield sub, f"{path}/{key}/{i}"


def find_keyword(schema: Any, keyword: str, path: str = "#") -> str | None:
    """JSON pointer of the first schema object using `keyword`, or None."""
    if not isinstance(schema, dict):
        return None
    if keyword in schema:
        return path
    for sub, where in _subschemas(schema, path):
        found = find_keyword(sub, keyword, where)
        if found:
            return found
    return None


def strict_schema(schema: Any) -> Any:
    """OpenAI's strict mode: objects allow no properties beyond those listed unless they say
    otherwise (the client is responsible for listing every property in `required`)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    for key in _SCHEMA_MAP:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_schema(v) for k, v in out[key].items()}
    for key in _SCHEMA_LIST:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(v) for v in out[key]]
    return out


def check_schema(schema: Any, param: str) -> None:
    """Metaschema check: GrammarError naming the keyword and its path."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{param}: a JSON schema must be an object or a boolean, "
                           f"got {type(schema).__name__}", param)
    cls = validator_for(schema if isinstance(schema, dict) else {}, default=jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    if error is not None:
        where = "#" + "".join(f"/{p}" for p in error.absolute_path)
        keyword = next((p for p in reversed(error.absolute_path) if isinstance(p, str)), error.validator)
        raise GrammarError(f"{param}: invalid JSON schema at {where} (keyword '{keyword}'): {error.message}",
                           param)


def compile_checked(spec: str, param: str, what: str) -> Grammar:
    """Validate llguidance grammar text; its refusal becomes a GrammarError."""
    is_error, messages = LLMatcher.validate_grammar_with_warnings(spec)
    if is_error:
        raise GrammarError(f"{param}: {what}: {_clean(messages[0] if messages else 'rejected')}", param)
    return Grammar(spec, param)


def _clean(message: str) -> str:
    # llguidance quotes the grammar with carets under the fault; one line reads better in an
    # HTTP error, and the quoted line adds nothing the client did not send.
    lines = [line.strip() for line in message.strip().splitlines()]
    head = " ".join(line for line in lines if line and not line.startswith(("^", "|")) and
                    not re.match(r"^\d+ \|", line))
    # "at 1(8): " points into llguidance's internal wrapping of a regex, not the client's text.
    return re.sub(r"^at \d+\(\d+\): ", "", re.sub(r"\s+", " ", head))


def check_size(schema: Any, param: str, size: int) -> None:
    """GrammarError past MAX_SCHEMA_BYTES of JSON text or MAX_PROPERTIES object properties in
    all (OpenAI's limit): checking and compiling cost time per property (~1 ms each)."""
    if size > MAX_SCHEMA_BYTES:
        raise GrammarError(f"{param}: the schema is {size} bytes of JSON; at most {MAX_SCHEMA_BYTES}", param)
    count, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("properties"), dict):
                count += len(node["properties"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    if count > MAX_PROPERTIES:
        raise GrammarError(f"{param}: the schema has {count} object properties; at most {MAX_PROPERTIES} "
                           f"in all", param)


def json_schema(schema: Any, param: str, strict: bool = False) -> Grammar:
    """A grammar producing JSON that validates against `schema` (see the module docstring)."""
    try:
        key = json.dumps(schema, allow_nan=False)  # not sorted: property order is the output order
    except (TypeError, ValueError):  # not JSON (a caller's Python object): no caching
        return _json_schema(schema, param, strict)
    check_size(schema, param, len(key.encode()))
    return _cached(key, param, strict)


# Agents send the same schemas turn after turn; checking and compiling one is the costly part.
@functools.lru_cache(maxsize=128)
def _cached(key: str, param: str, strict: bool) -> Grammar:
    return _json_schema(json.loads(key), param, strict)


def _json_schema(schema: Any, param: str, strict: bool) -> Grammar:
    check_schema(schema, param)
    if schema is False:
        raise GrammarError(f"{param}: the schema is false, which no document matches", param)
    if schema is True:
        schema = {}  # any JSON value; llguidance's options need an object to sit in
    if strict:
        schema = strict_schema(schema)
    try:
        spec = LLMatcher.grammar_from_json_schema(copy.deepcopy(schema), defaults=copy.copy(JSON_OPTIONS))
    except (ValueError, TypeError) as e:  # x-guidance options of the wrong shape
        raise GrammarError(f"{param}: cannot compile the schema: {e}", param) from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(spec)
    if not is_error:
        return Grammar(spec, param)
    message = messages[0] if messages else "rejected"
    m = _UNIMPLEMENTED.search(message)
    if m:
        keywords = json.loads(f"[{m.group(1)}]")
        places = [f"'{k}' at {find_keyword(schema, k) or '#'}" for k in keywords]
        noun = "keyword" if len(keywords) == 1 else "keywords"
        raise GrammarError(f"{param}: unsupported JSON schema {noun} {', '.join(places)} "
                           f"(structured output cannot enforce {'it' if len(keywords) == 1 else 'them'})", param)
    if "regex parse error" in message:  # llguidance does not say which pattern
        where = find_keyword(schema, "pattern") or find_keyword(schema, "patternProperties") or "#"
        raise GrammarError(f"{param}: unsupported 'pattern' at {where}: {_clean(message)}", param)
    raise GrammarError(f"{param}: unsupported JSON schema: {_clean(message)}", param)


def json_object(param: str) -> Grammar:
    """Any JSON object (OpenAI's json_object, Ollama's format "json")."""
    return json_schema({"type": "object"}, param)

"""Issue 14's acceptance: 200 documents over 10 schemas from a random-weight model (where only
the constraint can make the output valid) all parse and validate with jsonschema.

Schemas go through mlxlocal.grammar (as a request's would), the requests through the paged
engine all at once (the scheduler batches them), sampled with a seed each so the documents
differ. Strings and arrays are bounded: a random model fills them to the limit.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from mlxlocal import grammar
from mlxlocal.engine import SamplingParams, open_engine
from mlxlocal.source.loader import load_from_dir


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


INT = {"type": "integer", "minimum": -5, "maximum": 5}
SCHEMAS = {
    "nested objects": obj({
        "user": obj({"id": {"type": "integer", "minimum": 1, "maximum": 999}, "name": {"type": "string", "maxLength": 5}}),
        "meta": obj({"active": {"type": "boolean"}, "level": obj({"n": INT})}),
    }),
    "array min/max items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                            "minItems": 2, "maxItems": 4},
    "enums": obj({"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", 1, None]}}),
    # multipleOf bounds the digits (binary fractions: jsonschema checks in floats): a plain "number" allows any number of them, and a random
    # model writes fractions until max_tokens (then finish "length", grammar incomplete).
    "numbers with ranges": obj({"t": {"type": "number", "minimum": -10.5, "maximum": 40, "multipleOf": 0.5},
                                "p": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
                                "q": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}}),
    "required/optional": obj({"a": {"type": "integer", "minimum": 0, "maximum": 5},
                              "b": {"type": "string", "maxLength": 4}, "c": {"type": "boolean"}}, required=["a"]),
    "anyOf": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"type": "string", "maxLength": 4},
                        obj({"k": {"type": "boolean"}})]},
    "string patterns": obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2,3}$"}}),
    "array of objects": {"type": "array", "items": obj({"id": {"type": "integer", "minimum": 0, "maximum": 50},
                                                        "ok": {"type": "boolean"}}),
                         "minItems": 1, "maxItems": 3},
    "$ref and const": {"$defs": {"pt": obj({"x": INT, "y": INT})},
                       **obj({"kind": {"const": "line"}, "from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}})},
    "nullable, format, enum items": obj({"when": {"type": "string", "format": "date"},
                                         "note": {"type": ["string", "null"], "maxLength": 6},
                                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}),
}
PER_SCHEMA = 20
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = open_engine(load_from_dir(tiny_model), block_size=16, kv_blocks=512, max_num_seqs=16)
    yield eng
    eng.shutdown()


def test_200_documents_over_10_schemas_all_validate(engine):
    assert len(SCHEMAS) == 10
    jobs = []
    for k, (name, schema) in enumerate(SCHEMAS.items()):
        constraint = grammar.json_schema(schema, f"schema {name}")
        for i in range(PER_SCHEMA):
            ids = engine.encode_text(f"Document {i} for {name}:")
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0 if i == 0 else 1.0, seed=k * 100 + i,
                                    grammar=constraint)
            jobs.append((name, schema, engine.submit(ids, params)))  # all queued before any is read
    assert len(jobs) == 200
    distinct: dict[str, set[str]] = {name: set() for name in SCHEMAS}
    for name, schema, handle in jobs:
        chunks = list(handle)
        text, stats = "".join(c.text for c in chunks), chunks[-1].stats
        assert stats.finish_reason == "stop" and stats.grammar_complete is True, (name, text)
        jsonschema.validate(json.loads(text), schema)
        distinct[name].add(text)
    # The sampler still samples inside the constraint: documents differ.
    assert all(len(texts) >= 5 for texts in distinct.values()), {n: len(t) for n, t in distinct.items()}

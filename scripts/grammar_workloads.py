"""The workloads of scripts/grammar_engines.py: JSON schemas and valid documents for them.

Kept apart so both halves of the comparison (the project's interpreter and the throwaway
one with xgrammar) build the very same documents from the same seed.
"""

from __future__ import annotations

import json
import random

VOCAB = 151936

# ---------------------------------------------------------------- schemas

_STR = {"type": "string"}
_COUNTRIES = ["FR", "DE", "US", "JP", "BR", "IN", "GB", "CA"]
_TAGS = ["fragile", "gift", "perishable", "oversize", "digital", "refurbished"]

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": _STR,
                "email": _STR,
                "address": {
                    "type": "object",
                    "properties": {
                        "street": _STR,
                        "city": _STR,
                        "country": {"enum": _COUNTRIES},
                        "postal_code": _STR,
                    },
                    "required": ["street", "city", "country", "postal_code"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "email", "address"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": _STR,
                    "description": _STR,
                    "quantity": {"type": "integer", "minimum": 1},
                    "unit_price": {"type": "number", "minimum": 0},
                    "tags": {"type": "array", "items": {"enum": _TAGS}},
                },
                "required": ["sku", "description", "quantity", "unit_price", "tags"],
                "additionalProperties": False,
            },
        },
        "total": {"type": "number"},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["order_id", "status", "customer", "items", "total", "notes"],
    "additionalProperties": False,
}

CALENDAR_SCHEMA = {
    "type": "object",
    "properties": {
        "calendar": _STR,
        "timezone": {"enum": ["UTC", "Europe/Paris", "America/New_York", "Asia/Tokyo"]},
        "events": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "title": _STR,
                    "start": {"type": "string",
                              "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}$"},
                    "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
                    "attendees": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "name": _STR,
                                "role": {"enum": ["organizer", "required", "optional"]},
                                "accepted": {"type": "boolean"},
                            },
                            "required": ["name", "role", "accepted"],
                            "additionalProperties": False,
                        },
                    },
                    "location": {
                        "anyOf": [
                            {"type": "null"},
                            {
                                "type": "object",
                                "properties": {
                                    "name": _STR,
                                    "lat": {"type": "number"},
                                    "lon": {"type": "number"},
                                },
                                "required": ["name", "lat", "lon"],
                                "additionalProperties": False,
                            },
                        ]
                    },
                    "priority": {"enum": ["low", "normal", "high", "urgent"]},
                    "recurring": {"type": "boolean"},
                },
                "required": ["id", "title", "start", "duration_minutes", "attendees",
                             "location", "priority", "recurring"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["calendar", "timezone", "events"],
    "additionalProperties": False,
}

_TOOL_ARGS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": _STR,
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
        },
        "required": ["city", "unit", "days"],
        "additionalProperties": False,
    },
    "search_web": {
        "type": "object",
        "properties": {
            "query": _STR,
            "max_results": {"type": "integer", "minimum": 1, "maximum": 50},
            "sites": {"type": "array", "items": _STR},
        },
        "required": ["query", "max_results", "sites"],
        "additionalProperties": False,
    },
    "read_file": {
        "type": "object",
        "properties": {
            "path": _STR,
            "offset": {"type": "integer", "minimum": 0},
            "limit": {"type": "integer", "minimum": 1},
        },
        "required": ["path", "offset", "limit"],
        "additionalProperties": False,
    },
}

TOOLS_SCHEMA = {
    "type": "object",
    "properties": {
        "thought": _STR,
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "tool_calls": {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"name": {"const": name}, "arguments": args},
                        "required": ["name", "arguments"],
                        "additionalProperties": False,
                    }
                    for name, args in _TOOL_ARGS.items()
                ]
            },
        },
    },
    "required": ["thought", "confidence", "tool_calls"],
    "additionalProperties": False,
}

OBJECT_SCHEMA = {"type": "object"}

# ---------------------------------------------------------------- documents

_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
          "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
          "zulu weather report meeting budget review launch quarterly planning sync design "
          "Paris Berlin Tokyo Lisbon Osaka Montreal Nairobi Lima Oslo Seoul").split()


def _text(r: random.Random, lo: int, hi: int) -> str:
    return " ".join(r.choice(_WORDS) for _ in range(r.randint(lo, hi)))


def _order(r: random.Random) -> dict:
    items = [{
        "sku": f"SKU-{r.randint(1000, 99999)}",
        "description": _text(r, 2, 6),
        "quantity": r.randint(1, 12),
        "unit_price": round(r.uniform(0.5, 500), 2),
        "tags": r.sample(_TAGS, r.randint(0, 3)),
    } for _ in range(r.randint(3, 6))]
    return {
        "order_id": f"ORD-{r.randint(0, 999999):06d}",
        "status": r.choice(ORDER_SCHEMA["properties"]["status"]["enum"]),
        "customer": {
            "name": _text(r, 2, 3).title(),
            "email": f"{r.choice(_WORDS).lower()}.{r.randint(1, 999)}@example.com",
            "address": {
                "street": f"{r.randint(1, 300)} {_text(r, 1, 3)} street",
                "city": r.choice(_WORDS),
                "country": r.choice(_COUNTRIES),
                "postal_code": f"{r.randint(10000, 99999)}",
            },
        },
        "items": items,
        "total": round(sum(i["quantity"] * i["unit_price"] for i in items), 2),
        "notes": _text(r, 3, 10) if r.random() < 0.6 else None,
    }


def _calendar(r: random.Random) -> dict:
    events = []
    for _k in range(r.randint(2, 4)):
        events.append({
            "id": r.randint(1, 10**6),
            "title": _text(r, 2, 5),
            "start": f"2026-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}T"
                     f"{r.randint(0, 23):02d}:{r.choice([0, 15, 30, 45]):02d}",
            "duration_minutes": r.choice([15, 30, 45, 60, 90, 120]),
            "attendees": [{"name": _text(r, 1, 2).title(),
                           "role": r.choice(["organizer", "required", "optional"]),
                           "accepted": r.random() < 0.5} for _ in range(r.randint(1, 4))],
            "location": None if r.random() < 0.3 else {
                "name": _text(r, 1, 3), "lat": round(r.uniform(-90, 90), 5),
                "lon": round(r.uniform(-180, 180), 5)},
            "priority": r.choice(["low", "normal", "high", "urgent"]),
            "recurring": r.random() < 0.3,
        })
    return {"calendar": _text(r, 1, 3), "timezone": r.choice(["UTC", "Europe/Paris"]),
            "events": events}


def _tools(r: random.Random) -> dict:
    calls = []
    for _ in range(r.randint(2, 5)):
        name = r.choice(list(_TOOL_ARGS))
        if name == "get_weather":
            args = {"city": r.choice(_WORDS), "unit": r.choice(["celsius", "fahrenheit"]),
                    "days": r.randint(1, 14)}
        elif name == "search_web":
            args = {"query": _text(r, 3, 8), "max_results": r.randint(1, 50),
                    "sites": [f"{r.choice(_WORDS).lower()}.org" for _ in range(r.randint(0, 3))]}
        else:
            args = {"path": "/".join(r.choice(_WORDS).lower() for _ in range(3)) + ".txt",
                    "offset": r.randint(0, 5000), "limit": r.randint(1, 400)}
        calls.append({"name": name, "arguments": args})
    return {"thought": _text(r, 8, 20), "confidence": round(r.random(), 3), "tool_calls": calls}


def _anything(r: random.Random) -> dict:
    # JSON object mode: arbitrary nesting, mixed value types, unicode and escapes.
    def value(depth: int):
        k = r.randint(0, 6 if depth < 3 else 3)
        if k == 0:
            return r.randint(-10**6, 10**6)
        if k == 1:
            return round(r.uniform(-1e4, 1e4), 4)
        if k == 2:
            return r.choice([True, False, None])
        if k == 3:
            return _text(r, 1, 6) + r.choice(["", " \"quoted\"", " caf\u00e9", "\n", " \u2713"])
        if k == 4:
            return [value(depth + 1) for _ in range(r.randint(0, 4))]
        return {r.choice(_WORDS).lower() + str(i): value(depth + 1) for i in range(r.randint(1, 4))}
    return {f"{r.choice(_WORDS).lower()}_{i}": value(0) for i in range(r.randint(4, 8))}


WORKLOADS = {
    "schema:order": (ORDER_SCHEMA, _order),
    "schema:calendar": (CALENDAR_SCHEMA, _calendar),
    "schema:tool_calls": (TOOLS_SCHEMA, _tools),
    "json_object": (OBJECT_SCHEMA, _anything),
}


def make_docs(name: str, n: int, seed: int) -> list[str]:
    make = WORKLOADS[name][1]
    r = random.Random(f"{seed}:{name}")
    return [json.dumps(make(r), ensure_ascii=False) for _ in range(n)]

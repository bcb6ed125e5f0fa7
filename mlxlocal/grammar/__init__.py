"""Constraints on generated text, built from what a request asked for.

Each builder checks its input and returns an `engine.Grammar` (llguidance grammar text plus
the request field it came from), or raises `GrammarError` naming that field and the fault,
so a front end can refuse the request before anything is generated. The engine applies the
grammar token by token. See schema.py for the JSON Schema keywords supported and refused.
"""

from mlxlocal.grammar.errors import GrammarError
from mlxlocal.grammar.formats import choice, gbnf, lark, regex, with_reasoning
from mlxlocal.grammar.schema import json_object, json_schema
from mlxlocal.grammar.tools import tool_calls

__all__ = ["GrammarError", "choice", "gbnf", "json_object", "json_schema", "lark", "regex", "tool_calls",
           "with_reasoning"]

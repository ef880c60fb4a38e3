"""Bounds on the digits of JSON-schema numbers, so that a small model cannot write digits forever.

A schema's `integer` or `number` without bounds lets the grammar accept any number of digits, and a
small model that starts `"population": 1111...` keeps going until max_tokens cuts the JSON off
(seen on SmolLM2-135M). Before compiling, an integer without `minimum` / `maximum` gets the 64-bit
range, which llguidance compiles to a digit-bounded pattern (19 digits); a number without them gets
+-1e15, and without `multipleOf` a `multipleOf` of 1e-6 (at most 6 fraction digits; about 21
significant digits in all, a double's 17 and a little). llguidance takes bounds through a double:
2**63-1 rounds to 2**63 and fails to compile, so the integer bounds are +-(2**63 - 1024), the largest
double below it. Bounds a schema states itself are kept (only the missing side is added); a number
with `multipleOf` is left with it. The cost: a `number` under this rewrite has no exponent form and
no values beyond 1e15 or finer than 1e-6 (--no-structured-outputs-bound-numbers keeps
JSON Schema's unbounded numbers).
"""
from __future__ import annotations

import json
import math

INT_BOUND = 2**63 - 1024
NUMBER_BOUND = 1e15
NUMBER_STEP = 1e-6

# keywords whose values hold subschemas: a map of them, a list of them, or one
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_ONES = ("additionalProperties", "additionalItems", "contains", "if", "then", "else", "propertyNames",
         "unevaluatedProperties", "unevaluatedItems", "not")


def bound_numbers(schema):
    """A copy of the schema with every integer and number bounded (module docstring)."""
    if isinstance(schema, list):
        return [bound_numbers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _MAPS and isinstance(value, dict):
            value = {k: bound_numbers(v) for k, v in value.items()}
        elif (key in _LISTS or key == "items") and isinstance(value, list):
            value = [bound_numbers(v) for v in value]
        elif (key in _ONES or key == "items") and isinstance(value, dict):
            value = bound_numbers(value)
        out[key] = value
    types = out.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if "integer" in types and "number" not in types:
        _bound(out, INT_BOUND)
    elif "number" in types:
        _bound(out, NUMBER_BOUND)
        if "multipleOf" not in out and "integer" not in types and _has_step(out):
            out["multipleOf"] = NUMBER_STEP
    return out


def _bound(schema: dict, limit) -> None:
    """Adds the missing side(s) of +-limit, unless the stated other side lies beyond it (the range
    would be empty: such a schema is left as written)."""
    lo = _number(schema.get("minimum", schema.get("exclusiveMinimum")))
    hi = _number(schema.get("maximum", schema.get("exclusiveMaximum")))
    if "minimum" not in schema and "exclusiveMinimum" not in schema and (hi is None or hi > -limit):
        schema["minimum"] = -limit
    if "maximum" not in schema and "exclusiveMaximum" not in schema and (lo is None or lo < limit):
        schema["maximum"] = limit


def _has_step(schema: dict) -> bool:
    """Whether some multiple of NUMBER_STEP lies within the schema's stated bounds."""
    lo = _number(schema.get("minimum", schema.get("exclusiveMinimum")))
    hi = _number(schema.get("maximum", schema.get("exclusiveMaximum")))
    if lo is None or hi is None:
        return True
    return math.floor(hi / NUMBER_STEP) - math.ceil(lo / NUMBER_STEP) >= 2  # room for exclusive ends


def _number(value):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def bound_numbers_text(text: str) -> str:
    """bound_numbers on a schema's JSON text; text that is not JSON is left for the compiler's error."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text
    return json.dumps(bound_numbers(schema))

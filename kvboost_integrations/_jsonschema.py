"""The small part of JSON Schema that schema-guided generation reads."""
from __future__ import annotations

import json

from kvboost_engine import InputError


def type_of(schema: dict) -> str | None:
    """The schema's type; for a list of types, the first that is not "null"."""
    kind = schema.get("type")
    if isinstance(kind, list):
        real = [k for k in kind if k != "null"]
        kind = real[0] if real else "null"
    if kind is None and "properties" in schema:
        return "object"
    return kind


def resolve(root: dict, schema: dict) -> dict:
    """Follow $ref (local), and take the first non-null branch of anyOf/oneOf/one-item allOf."""
    for _ in range(32):
        if "$ref" in schema:
            schema = _follow_ref(root, schema["$ref"])
        elif "anyOf" in schema or "oneOf" in schema:
            options = schema.get("anyOf") or schema.get("oneOf")
            real = [s for s in options if type_of(s) != "null"]
            schema = (real or options)[0]
        elif "allOf" in schema and len(schema["allOf"]) == 1:
            schema = schema["allOf"][0]
        else:
            return schema
    raise InputError("schema $ref chain is too long or circular")


def _follow_ref(root: dict, ref: str) -> dict:
    if not ref.startswith("#/"):
        raise InputError(f"only local schema references (#/...) are supported, got {ref!r}")
    node = root
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def finish_number(digits: str, integer: bool, schema: dict) -> str:
    """A complete JSON number from the digits chosen so far, within the schema's bounds."""
    digits = digits.rstrip(".")
    if digits in ("", "-"):
        digits = "0"
    value = int(digits) if integer else float(digits)
    step = 1 if integer else 1e-6
    lows = [schema[k] + (step if k.startswith("exclusive") else 0)
            for k in ("minimum", "exclusiveMinimum") if isinstance(schema.get(k), (int, float))]
    highs = [schema[k] - (step if k.startswith("exclusive") else 0)
             for k in ("maximum", "exclusiveMaximum") if isinstance(schema.get(k), (int, float))]
    if lows:
        value = max(value, max(lows))
    if highs:
        value = min(value, min(highs))
    return json.dumps(int(value) if integer else value)

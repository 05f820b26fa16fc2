"""JSON Schemas as the decoder enforces them.

llguidance follows JSON Schema literally: an object that does not say `additionalProperties`
accepts any extra key, so a small model may keep inventing keys until it runs out of tokens.
We close such objects (`additionalProperties: false`) unless the schema says otherwise, except
inside `allOf` branches (closing two merged branches would make them unsatisfiable). JSON is
written as `json.dumps` writes it (", " and ": ", no other whitespace): what models saw most.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping

from ..errors import InputError

# Options of llguidance's JSON compiler (its "x-guidance" key inside a schema).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_COMBINERS = ("allOf", "anyOf", "oneOf", "$ref")     # beside `properties`: keys from elsewhere join the object
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalProperties", "contains", "not", "if", "then", "else")


def prepare_schema(schema) -> dict:
    """A copy of `schema` with open objects closed and our JSON style set (user's x-guidance wins)."""
    if schema is True:
        schema = {}
    if schema is False:
        raise InputError("the JSON schema `false` accepts no value at all")
    if not isinstance(schema, Mapping):
        raise InputError(f"a JSON schema must be a dict (or a bool), got {type(schema).__name__}")
    closed = copy.deepcopy(dict(schema))
    keep_open = _merged_refs(closed)
    _close(closed, keep_open)
    closed["x-guidance"] = {**JSON_STYLE, **(closed.get("x-guidance") or {})}
    return closed


def _close(node, keep_open: set[str], path: str = "#", merged: bool = False) -> None:
    """Close open objects in place, walking every subschema but the branches of `allOf`. An object
    whose properties meet others at the same level (`allOf`, `anyOf`, `oneOf` or `$ref` beside its
    `properties`) stays open, and so do its `anyOf` / `oneOf` branches (`merged`): each side's keys
    are the other's additional properties, and closing either would forbid them."""
    if not isinstance(node, dict):
        return
    combined = "properties" in node and any(key in node for key in _COMBINERS)
    if ("properties" in node and not any(key in node for key in _OPEN_KEYS) and path not in keep_open
            and not combined and not merged):
        node["additionalProperties"] = False
        properties = node["properties"]
        if isinstance(properties, Mapping) and isinstance(node.get("required"), (list, tuple)):
            extra = {name: {} for name in node["required"] if isinstance(name, str) and name not in properties}
            if extra:                   # a required key with no schema of its own: any value (closing forbade it)
                node["properties"] = {**properties, **extra}
    for key in _SCHEMA_LISTS:
        subs = node.get(key)
        if subs is not None and not isinstance(subs, (list, tuple)):
            raise InputError(f"JSON schema {path}/{key} must be a list of schemas, got {type(subs).__name__}")
        for index, sub in enumerate(subs or ()):
            _close(sub, keep_open, f"{path}/{key}/{index}", merged=combined and key != "prefixItems")
    for key in _SCHEMA_MAPS:
        subs = node.get(key)
        if subs is not None and not isinstance(subs, Mapping):
            raise InputError(f"JSON schema {path}/{key} must be an object of schemas, got {type(subs).__name__}")
        for name, sub in (subs or {}).items():
            _close(sub, keep_open, f"{path}/{key}/{name}")
    for key in _SCHEMA_VALUES:
        _close(node.get(key), keep_open, f"{path}/{key}")


def _merged_refs(schema: dict) -> set[str]:
    """Pointers of definitions that some `allOf` merges with other branches, or that an object merges
    with its own properties (a `$ref`, or `anyOf` / `oneOf` branches, beside them): they stay open."""
    found: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            branches = node.get("allOf")
            if isinstance(branches, list) and len(branches) > 1:
                found.update(b["$ref"] for b in branches if isinstance(b, dict) and isinstance(b.get("$ref"), str))
            if "properties" in node:            # a $ref, or anyOf / oneOf branches that are $refs, beside them
                if isinstance(node.get("$ref"), str):
                    found.add(node["$ref"])
                for key in ("anyOf", "oneOf"):
                    for b in node.get(key) if isinstance(node.get(key), list) else ():
                        if isinstance(b, dict) and isinstance(b.get("$ref"), str):
                            found.add(b["$ref"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return found

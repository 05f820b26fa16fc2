"""Seeded random JSON Schemas for the conformance benchmark (benchmarks/micro/schemas.py).

Every schema is an object mixing what extraction schemas use: nested objects, arrays with up to
10 items (beyond 5), optional properties, nullable values (both `anyOf [X, null]` and
`type: [X, "null"]`), enums of strings, numbers and both, integers and numbers with bounds
(inclusive and exclusive), strings with patterns, and strings with min/max lengths.
"""
from __future__ import annotations

import random

PATTERNS = ["^[A-Z]{3}-[0-9]{3}$", "^[0-9]{4}-[0-9]{2}-[0-9]{2}$", "^[A-Z][a-z]{2,9}$", "^\\+?[0-9]{7,12}$",
            "^[a-z]{2,8}(-[a-z]{2,8}){0,2}$", "^#[0-9a-f]{6}$"]
WORDS = ["name", "city", "code", "price", "count", "tags", "items", "owner", "status", "score", "level", "note",
         "colour", "size", "weight", "rating", "active", "email", "phone", "date", "parts", "address", "unit", "kind"]
ENUMS = [["red", "green", "blue"], ["S", "M", "L", "XL"], [1, 2, 3, 5, 8], [0.5, 1.5, 2.5],
         ["low", 2, "high"], ["yes", "no", None]]


class SchemaGen:
    """`schema(index)`: the index-th schema of the seeded series (the same for the same seed)."""

    def __init__(self, seed: int = 0):
        self.seed = seed

    def schema(self, index: int) -> dict:
        rng = random.Random(self.seed * 100_003 + index)
        schema = self._object(rng, depth=0, size=rng.randint(3, 6))
        schema["title"] = f"Record{index}"
        return schema

    def _object(self, rng: random.Random, depth: int, size: int | None = None) -> dict:
        names = rng.sample(WORDS, size or rng.randint(2, 4))
        properties = {name: self._value(rng, depth + 1) for name in names}
        required = [name for name in names if rng.random() < 0.7] or names[:1]    # the rest optional
        return {"type": "object", "properties": properties, "required": required}

    def _value(self, rng: random.Random, depth: int) -> dict:
        kinds = ["string", "pattern", "integer", "number", "boolean", "enum", "array", "object", "nullable"]
        weights = [3, 2, 2, 2, 1, 2, 2 if depth < 3 else 0, 2 if depth < 2 else 0, 2]
        kind = rng.choices(kinds, weights)[0]
        return getattr(self, "_" + kind)(rng, depth)

    def _string(self, rng: random.Random, depth: int) -> dict:
        low = rng.choice([0, 1, 3])
        return {"type": "string", "minLength": low, "maxLength": low + rng.choice([5, 10, 20, 40])}

    def _pattern(self, rng: random.Random, depth: int) -> dict:
        return {"type": "string", "pattern": rng.choice(PATTERNS)}

    def _integer(self, rng: random.Random, depth: int) -> dict:
        low = rng.randint(-100, 100)
        if rng.random() < 0.3:
            return {"type": "integer", "exclusiveMinimum": low, "exclusiveMaximum": low + rng.randint(2, 1000)}
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}

    def _number(self, rng: random.Random, depth: int) -> dict:
        low = round(rng.uniform(-50, 50), 1)
        bound = "exclusiveMaximum" if rng.random() < 0.3 else "maximum"
        return {"type": "number", "minimum": low, bound: round(low + rng.uniform(1, 500), 1)}

    def _boolean(self, rng: random.Random, depth: int) -> dict:
        return {"type": "boolean"}

    def _enum(self, rng: random.Random, depth: int) -> dict:
        return {"enum": list(rng.choice(ENUMS))}

    def _array(self, rng: random.Random, depth: int) -> dict:
        most = rng.choice([3, 6, 8, 10])
        least = rng.choice([0, 1, min(6, most)])
        item_kind = rng.choice(["string", "pattern", "integer", "enum"] + (["object"] if depth < 2 else []))
        items = self._object(rng, depth + 1, 2) if item_kind == "object" else getattr(self, "_" + item_kind)(rng, depth)
        return {"type": "array", "items": items, "minItems": least, "maxItems": most}

    def _nullable(self, rng: random.Random, depth: int) -> dict:
        inner = rng.choice([self._string, self._integer, self._number, self._enum])(rng, depth)
        if "type" in inner and rng.random() < 0.5:
            return {**inner, "type": [inner["type"], "null"]}
        return {"anyOf": [inner, {"type": "null"}]}


def features(schema) -> set[str]:
    """Which generator features a schema uses (for the benchmark's coverage figures)."""
    found: set[str] = set()

    def walk(node, required: bool = True) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        kind = node.get("type")
        if "anyOf" in node or (isinstance(kind, list) and "null" in kind):
            found.add("nullable")
        found.update(key for key in ("pattern", "maxLength", "enum") if key in node)
        if any(key in node for key in ("minimum", "exclusiveMinimum")):
            found.add("number bounds")
        if kind == "array" and node.get("maxItems", 0) > 5:
            found.add("arrays beyond 5 items")
        if kind == "object":
            found.add("object")
            if set(node.get("properties", {})) - set(node.get("required", [])):
                found.add("optional properties")
        for key in ("properties",):
            for sub in (node.get(key) or {}).values():
                if isinstance(sub, dict) and sub.get("type") == "object":
                    found.add("nested objects")
                walk(sub)
        walk(node.get("items"))
        walk(node.get("anyOf"))

    walk(schema)
    return found

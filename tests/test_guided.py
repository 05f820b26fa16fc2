"""Schema-guided JSON (framework-neutral): always parses, always matches the schema."""
import json

import pytest

from kvboost_engine import Engine, InputError
from kvboost_integrations._guided import json_stream
from kvboost_integrations._jsonschema import finish_number, resolve
from kvboost_integrations._vocab import Vocabulary

SCHEMA = {
    "$defs": {"Step": {"type": "object", "properties": {
        "title": {"type": "string"},
        "minutes": {"type": "number", "minimum": 0.5, "maximum": 90},
        "tool": {"anyOf": [{"enum": ["oven", "pan", "bowl"]}, {"type": "null"}]}}}},
    "type": "object",
    "properties": {"dish": {"type": "string"}, "vegan": {"type": "boolean"}, "kind": {"const": "recipe"},
                   "steps": {"type": "array", "items": {"$ref": "#/$defs/Step"}, "minItems": 1, "maxItems": 2}},
}


@pytest.fixture(scope="module")
def guided_engine(smol):
    return Engine(*smol, cache_bytes=64 * 2**20)


def test_numbers_are_completed_and_kept_within_bounds():
    assert finish_number("", True, {}) == "0"
    assert finish_number("12.", False, {}) == "12.0"
    assert finish_number("5000", True, {"exclusiveMaximum": 1000}) == "999"
    assert finish_number("-7", True, {"minimum": 0, "exclusiveMinimum": 2}) == "3"


def test_schema_references_and_unions_resolve():
    step = resolve(SCHEMA, SCHEMA["properties"]["steps"]["items"])
    assert set(step["properties"]) == {"title", "minutes", "tool"}
    assert resolve(SCHEMA, step["properties"]["tool"]) == {"enum": ["oven", "pan", "bowl"]}
    with pytest.raises(InputError, match="local"):
        resolve({}, {"$ref": "https://example.com/s.json"})


def test_vocabulary_finds_tokens_spelling_a_prefix(smol):
    vocab = Vocabulary(smol[1])
    found = {piece for _, piece, _ in vocab.prefix_tokens('"oven"', allow_space=False)}
    assert '"' in found and all('"oven"'.startswith(p) for p in found)


def test_guided_json_parses_and_matches_a_nested_schema(guided_engine, smol):
    stream = json_stream(guided_engine, Vocabulary(smol[1]), [{"role": "user", "content": "A quick pasta recipe."}],
                         SCHEMA, max_new_tokens=20)
    streamed = "".join(stream)
    data = json.loads(streamed)
    assert streamed == stream.generation.text
    assert set(data) == {"dish", "vegan", "kind", "steps"} and data["kind"] == "recipe"
    assert isinstance(data["vegan"], bool) and 1 <= len(data["steps"]) <= 2
    for step in data["steps"]:
        assert 0.5 <= step["minutes"] <= 90 and step["tool"] in ("oven", "pan", "bowl")
    assert stream.generation.usage()["output_tokens"] > 0


def test_top_level_must_be_an_object_or_array(guided_engine, smol):
    with pytest.raises(InputError, match="top level"):
        json_stream(guided_engine, Vocabulary(smol[1]), [{"role": "user", "content": "x"}], {"type": "string"})

"""Grammar-constrained decoding in the engine (llguidance): valid output, real tokens and usage,
honest finish reasons, and errors before any decoding for what cannot be enforced."""
import json

import jsonschema
import pytest
import torch

from kvboost_engine import Engine, InputError
from kvboost_engine.constrained import (AnyJson, Choice, JsonSchema, Lark, LogitsConstraint, Regex, TaggedJson,
                                        prepare_schema)
from kvboost_engine.constrained import vocab as vocab_module
from tiny_models import tiny_model

PET = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "kind": {"enum": ["cat", "dog", "bird"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "owner": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}},
    "required": ["name", "kind", "age", "owner"]}
ASK = [{"role": "user", "content": "Describe a pet as JSON."}]


@pytest.fixture(scope="module")
def grammar_engine(smol):
    return Engine(*smol, cache_bytes=64 * 2**20)


def test_open_objects_are_closed_except_where_the_schema_or_an_allof_says_otherwise():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"x": {"type": "integer"}}},
                                               "m": {"type": "object", "additionalProperties": {"type": "integer"}},
                                               "b": {"allOf": [{"$ref": "#/$defs/B"}, {"$ref": "#/$defs/C"}]}},
              "$defs": {"B": {"properties": {"y": {}}}, "C": {"properties": {"z": {}}}, "D": {"properties": {}}}}
    closed = prepare_schema(schema)
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["m"]["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in closed["$defs"]["B"] and "additionalProperties" not in closed["$defs"]["C"]
    assert closed["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in schema                      # the caller's schema is not touched
    assert closed["x-guidance"]["whitespace_flexible"] is False


def test_a_required_key_without_a_schema_of_its_own_stays_allowed_when_the_object_is_closed(grammar_engine):
    """Closing the object forbade a key that `required` names but `properties` does not describe: a
    valid schema was refused as unsatisfiable ("required property 'b' is unsatisfiable")."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}
    closed = prepare_schema(schema)
    assert closed["properties"] == {"a": {"type": "integer"}, "b": {}} and closed["additionalProperties"] is False
    assert schema["properties"] == {"a": {"type": "integer"}}
    grammar_engine.constraint(JsonSchema(schema))                      # accepted


def test_json_schema_output_validates_with_real_tokens_and_usage(grammar_engine, smol):
    stream = grammar_engine.stream_chat(ASK, constraint=JsonSchema(PET), max_new_tokens=60)
    streamed = "".join(stream)
    gen = stream.generation
    assert gen.finish_reason == "stop" and streamed == gen.text
    jsonschema.validate(json.loads(gen.text), PET)
    ids = [t for t in gen.token_ids if t not in (0, 2)]
    assert smol[1].decode(ids) == gen.text and gen.usage()["output_tokens"] == len(gen.token_ids)
    assert gen.prompt_tokens == grammar_engine.count_tokens(ASK) and gen.ttft_s > 0


def test_max_new_tokens_cuts_with_finish_reason_length(grammar_engine):
    gen = grammar_engine.chat(ASK, constraint=JsonSchema(PET), max_new_tokens=4)
    assert gen.finish_reason == "length" and gen.completion_tokens == 4
    assert gen.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(gen.text)


@pytest.mark.parametrize("grammar, check", [
    (Regex(r"[0-9]{3}-[a-z]{2}"), lambda t: len(t) == 6 and t[:3].isdigit() and t[3] == "-"),
    (Choice(["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
    (Lark('start: "Answer: " NUMBER\nNUMBER: /[1-9][0-9]?/'), lambda t: t.startswith("Answer: ") and t[8:].isdigit()),
    (AnyJson(), lambda t: isinstance(json.loads(t), dict)),
])
def test_regex_choice_lark_and_any_json(grammar_engine, grammar, check):
    gen = grammar_engine.chat([{"role": "user", "content": "Answer briefly."}], constraint=grammar, max_new_tokens=30)
    assert gen.finish_reason == "stop" and check(gen.text), gen.text


def test_sampling_under_a_constraint_stays_valid(grammar_engine):
    for seed in (1, 2):
        gen = grammar_engine.chat(ASK, constraint=JsonSchema(PET), max_new_tokens=60, temperature=1.0, seed=seed)
        if gen.finish_reason == "stop":
            jsonschema.validate(json.loads(gen.text), PET)
        else:
            assert gen.finish_reason == "length"


def test_tagged_json_writes_the_wrapper_and_special_tokens_are_single_tokens(grammar_engine, smol):
    tools = {"type": "object", "properties": {"name": {"const": "add"},
                                              "arguments": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
    gen = grammar_engine.chat(ASK, constraint=TaggedJson("<tool_call>\n", tools, "\n</tool_call>"), max_new_tokens=40)
    assert gen.finish_reason == "stop" and gen.text.startswith('<tool_call>\n{"name": "add", "arguments": {')
    body = json.loads(gen.text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert set(body["arguments"]) <= {"a"}
    literal = grammar_engine.constraint(Choice(["x"]))      # builds the grammar vocabulary
    assert isinstance(literal, LogitsConstraint)
    vocab = vocab_module.LazyVocab(smol[1], 49152, {2}).get()
    assert vocab.literal("a<|im_end|>b") == '"a" <[2]> "b"'


def test_end_of_sequence_only_where_the_output_is_complete(grammar_engine, smol):
    constraint = grammar_engine.constraint(JsonSchema({"type": "object", "properties": {"a": {"type": "integer"}},
                                                       "required": ["a"]}))
    logits = constraint.mask(torch.zeros(49152))
    assert logits[2] == float("-inf") and not constraint.is_finished()
    for token in smol[1].encode('{"a": 7}', add_special_tokens=False):
        assert constraint.mask(torch.zeros(49152))[token] == 0
        constraint.advance(token)
    assert constraint.is_finished()


@pytest.mark.parametrize("schema, named", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "pattern": "^(?=.*[0-9]).{3,}$"}, "look-around"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
])
def test_unsupported_schema_features_are_named_before_any_decoding(grammar_engine, schema, named):
    before = grammar_engine.stats()["requests"]
    with pytest.raises(InputError, match=named):
        grammar_engine.stream_chat(ASK, constraint=JsonSchema(schema))      # raised at the call, not on iteration
    assert grammar_engine.stats()["requests"] == before


def test_bad_constraint_arguments_are_input_errors(grammar_engine):
    with pytest.raises(InputError, match="stop strings"):
        grammar_engine.chat(ASK, constraint=AnyJson(), stop=["}"])
    with pytest.raises(InputError, match="constraint must be"):
        grammar_engine.chat(ASK, constraint={"type": "object"})
    with pytest.raises(InputError, match="non-empty"):
        grammar_engine.constraint(Choice([]))
    with pytest.raises(InputError, match="false"):
        grammar_engine.constraint(JsonSchema(False))


def test_the_grammar_vocabulary_is_built_once_per_engine(smol, monkeypatch):
    built = []
    original = vocab_module.GrammarVocab

    def counting(*args):
        built.append(args)
        return original(*args)

    monkeypatch.setattr(vocab_module, "GrammarVocab", counting)
    engine = Engine(*smol, cache_bytes=0)
    assert built == []                                       # nothing until a constraint is used
    engine.constraint(Choice(["a", "b"]))
    engine.constraint(JsonSchema({"type": "integer"}))
    assert len(built) == 1


def test_logits_beyond_the_tokenizer_are_never_chosen(smol):
    model = tiny_model("llama", vocab_size=49152 + 64)
    engine = Engine(model, smol[1], cache_bytes=0)
    gen = engine.chat(ASK, constraint=Choice(["left", "right"]), max_new_tokens=8)
    assert gen.text in ("left", "right") and max(gen.token_ids) < 49152


class _DeadEnd:
    """A constraint that allows nothing: its request must fail alone."""

    def mask(self, logits):
        return torch.full_like(logits, float("-inf"))

    def advance(self, token):
        raise AssertionError("never reached")

    def is_finished(self):
        return False


def test_constrained_and_free_requests_batch_together_with_their_solo_results(grammar_engine):
    asks = [(ASK, JsonSchema(PET)), ([{"role": "user", "content": "Say hi."}], None),
            ([{"role": "user", "content": "Pick a side."}], Choice(["left", "right"])),
            ([{"role": "user", "content": "Count to three."}], Regex(r"[0-9, ]{1,12}"))]
    solo = [grammar_engine.chat(m, constraint=c, max_new_tokens=40).token_ids for m, c in asks]
    dead = grammar_engine.stream_chat(ASK, constraint=_DeadEnd(), max_new_tokens=8)
    streams = [grammar_engine.stream_chat(m, constraint=c, max_new_tokens=40) for m, c in asks]   # all queued
    with pytest.raises(InputError, match="allows no token"):
        list(dead)
    for stream in streams:
        list(stream)
    assert [s.generation.token_ids for s in streams] == solo
    jsonschema.validate(json.loads(streams[0].generation.text), PET)
    assert streams[2].generation.text in ("left", "right")


def test_an_object_whose_properties_meet_others_is_left_open(engine):
    """`properties` beside `anyOf`, `allOf` or a `$ref` (a union's shared key, a base class plus fields):
    closing either side made valid objects unsatisfiable or forbade the other side's keys."""
    from kvboost_engine.constrained.schema import prepare_schema

    cases = [({"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"],
               "anyOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]},
                         {"properties": {"y": {"type": "integer"}}, "required": ["y"]}]}, {"kind": "a", "x": 1}),
             ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
               "allOf": [{"properties": {"b": {"type": "integer"}}}]}, {"a": "s", "b": 1}),
             ({"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
               "$ref": "#/$defs/Base", "properties": {"extra": {"type": "string"}}, "required": ["extra"]},
              {"id": 1, "extra": "e"})]
    for schema, value in cases:
        prepared = prepare_schema(schema)
        assert "additionalProperties" not in prepared
        assert all("additionalProperties" not in b for b in prepared.get("anyOf", ()))
        constraint = engine.constraint(JsonSchema(schema))
        for token in engine.tokenizer.encode(json.dumps(value), add_special_tokens=False):
            assert constraint.mask(torch.zeros(engine._grammars.vocab_size))[token] != float("-inf"), (schema, value)
            constraint.advance(token)
        assert constraint.is_finished()
    plain = prepare_schema({"type": "object", "properties": {"a": {"type": "string"}}})
    assert plain["additionalProperties"] is False                  # a plain object is still closed


def _accepts(engine, grammar, text: str) -> bool:
    constraint = engine.constraint(grammar)
    for token in engine.tokenizer.encode(text, add_special_tokens=False):
        if constraint.mask(torch.zeros(engine._grammars.vocab_size))[token] == float("-inf"):
            return False
        constraint.advance(token)
    return constraint.is_finished()


def test_a_forced_call_enforces_tool_parameters_that_use_refs(engine):
    """Pydantic's `#/$defs/X`, zod's `#/definitions/X` and a recursive `#`: nested in the call's wrapper
    they resolved against the wrapper (an InputError, or the wrong schema enforced)."""
    from kvboost_engine.toolcalls import HERMES

    tree = {"type": "object", "properties": {"child": {"$ref": "#"}}}
    located = {"$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
               "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"]}
    grammar = HERMES.forced_call({"tree": tree, "where": located})
    call = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'
    assert _accepts(engine, grammar, call.format("tree", '{"child": {"child": {}}}'))
    assert not _accepts(engine, grammar, call.format("tree", '{"child": {"name": "tree", "arguments": {}}}'))
    assert _accepts(engine, grammar, call.format("where", '{"loc": {"city": "Paris"}}'))
    assert not _accepts(engine, grammar, call.format("where", '{"loc": {"town": "Paris"}}'))

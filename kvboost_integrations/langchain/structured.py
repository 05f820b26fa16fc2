"""Structured output as LangChain expects it, with one promise added: a reply that the token budget
cut (finish_reason "length") is an error, never a partial object (as ChatOpenAI's
LengthFinishReasonError)."""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from operator import itemgetter
from typing import Any

from langchain_core.exceptions import OutputParserException
from langchain_core.messages import BaseMessage, BaseMessageChunk
from langchain_core.runnables import Runnable, RunnableGenerator, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema


class LengthCutError(OutputParserException):
    """The structured reply was cut by max_tokens before it was complete (finish_reason "length")."""


def json_schema_of(schema: dict | type) -> dict:
    """The JSON schema the output must follow. A dict is used as it is (whatever its top level: an
    object, an array, an enum; titled or not), once unwrapped from a provider's forms (OpenAI's
    {"type": "json_schema", "json_schema": {"schema": ...}} and {"name", "schema", "strict"}, a tool
    or function dict's `parameters`, Anthropic's `input_schema`, Bedrock's `toolSpec.inputSchema.json`);
    LangChain's `convert_to_json_schema` only reads Pydantic classes, TypedDicts and functions
    (given a dict, it shrinks a titled non-object schema to its title: any JSON)."""
    if not isinstance(schema, dict):
        return convert_to_json_schema(schema)
    if schema.get("type") == "json_schema" and isinstance(schema.get("json_schema"), dict):
        schema = schema["json_schema"]
    if schema.get("type") == "function" and isinstance(schema.get("function"), dict):
        schema = schema["function"]
    spec = schema.get("toolSpec")
    if isinstance(spec, dict) and isinstance(spec.get("inputSchema"), dict) and isinstance(spec["inputSchema"].get("json"), dict):
        return spec["inputSchema"]["json"]          # Bedrock's tool form
    for key in ("schema", "parameters", "input_schema"):        # OpenAI's, a function's, Anthropic's tool form
        if isinstance(schema.get("name"), str) and isinstance(schema.get(key), dict):
            return schema[key]
    return schema


def complete_reply(message: BaseMessage) -> BaseMessage:
    """The message as is when the model finished it; LengthCutError when the token budget cut it."""
    finish = (getattr(message, "response_metadata", None) or {}).get("finish_reason")
    if finish != "length":
        return message
    usage = getattr(message, "usage_metadata", None) or {}
    spent = usage.get("output_tokens")
    budget = f" after {spent} tokens (the max_tokens budget)" if spent is not None else ""
    raise LengthCutError(f"the structured output was cut before it was complete: finish_reason='length'{budget}; "
                         "raise max_tokens, or ask for a shorter object", llm_output=str(message.content)[:2000])


def _so_far(whole: BaseMessage | None, chunk: BaseMessage) -> BaseMessage:
    return whole + chunk if isinstance(whole, BaseMessageChunk) and isinstance(chunk, BaseMessageChunk) else chunk


def _complete_chunks(chunks: Iterator[BaseMessage]) -> Iterator[BaseMessage]:
    """The reply's chunks passed on as they come (the parser after it streams partial objects), checked
    with `complete_reply` on the reply so far: the last chunk, which carries the finish_reason, raises
    LengthCutError where the budget cut it."""
    whole = None
    for chunk in chunks:
        whole = _so_far(whole, chunk)
        complete_reply(whole)
        yield chunk


async def _acomplete_chunks(chunks: AsyncIterator[BaseMessage]) -> AsyncIterator[BaseMessage]:
    whole = None
    async for chunk in chunks:
        whole = _so_far(whole, chunk)
        complete_reply(whole)
        yield chunk


def structured_chain(llm: Runnable, parser: Runnable, include_raw: bool) -> Runnable[Any, Any]:
    """llm | (length check) | parser; with include_raw, {"raw", "parsed", "parsing_error"} where a cut
    reply or a parse failure is the parsing_error and parsed is None. Streamed, it yields the parser's
    partial objects as the reply's chunks arrive (as ChatOpenAI's structured output does)."""
    checked = RunnableGenerator(_complete_chunks, _acomplete_chunks, name="complete_reply") | parser
    if not include_raw:
        return llm | checked
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | checked, parsing_error=lambda _: None)
    failed = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")

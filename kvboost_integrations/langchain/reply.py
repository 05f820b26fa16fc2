"""One ChatKVBoost request's chunks: engine deltas and the final Generation as AIMessageChunks.

- text: tool calls held back and parsed in the model's format (`ToolCallSplitter`);
- thinking (with `reasoning=True`): separated from the answer into
  `additional_kwargs["reasoning_content"]`, as langchain-ollama does;
- logprobs (when asked for): `response_metadata["logprobs"]["content"]` in ChatOpenAI's format;
- the last chunk: usage, finish reason and our telemetry.
LangChain adds the chunks up (strings and lists concatenated) into the invoke() result.
"""
from __future__ import annotations

from langchain_core.messages import AIMessageChunk
from langchain_core.outputs import ChatGenerationChunk

from kvboost_engine import Generation

from .._logprobs import LogprobTrail
from .._reasoning import ThinkingSplitter
from .._toolcalls import ToolCallSplitter
from ._settings import response_metadata, usage_metadata
from .tools import tool_call_chunks


class ChatReply:
    """Turns engine deltas and the final Generation into message chunks for one request."""

    def __init__(self, model_name: str, one_call: bool = False):
        self.model_name = model_name
        self.one_call = one_call                    # parallel_tool_calls=False: the first call only
        self.splitter = ToolCallSplitter(None)      # replaced when the request starts
        self.thinking: ThinkingSplitter | None = None   # set when the request separates thinking
        self.documents_from_cache: int | None = None
        self.logprobs = LogprobTrail()

    def chunk(self, item: str | Generation) -> ChatGenerationChunk | None:
        return self._final(item) if isinstance(item, Generation) else self._delta(item)

    def _delta(self, delta: str) -> ChatGenerationChunk | None:
        self.logprobs.feed(delta)
        thought, answer = self.thinking.feed(delta) if self.thinking is not None else ("", delta)
        visible = self.splitter.feed(answer) if answer else ""
        if not (visible or thought):
            return None
        entries = self.logprobs.take()
        metadata = {"logprobs": {"content": entries}} if entries else {}
        extra = {"reasoning_content": thought} if thought else {}
        return ChatGenerationChunk(message=AIMessageChunk(content=visible, additional_kwargs=extra,
                                                          response_metadata=metadata))

    def _final(self, gen: Generation) -> ChatGenerationChunk:
        thought, answer = self.thinking.finish() if self.thinking is not None else ("", "")
        head = self.splitter.feed(answer) if answer else ""
        rest, calls = self.splitter.finish(cut=gen.finish_reason != "stop")
        calls = (tool_call_chunks(calls) or _server_tool_calls(gen))[:1 if self.one_call else None]
        finish = "tool_calls" if calls else gen.finish_reason
        metadata = response_metadata(gen, self.model_name, finish)
        if self.documents_from_cache is not None:
            metadata["documents_from_cache"] = self.documents_from_cache
        entries = self.logprobs.rest(gen)
        if entries is not None:
            metadata["logprobs"] = {"content": entries}
        message = AIMessageChunk(content=head + rest, tool_call_chunks=calls, usage_metadata=usage_metadata(gen),
                                 additional_kwargs={"reasoning_content": thought} if thought else {},
                                 response_metadata=metadata, chunk_position="last")
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": finish})


def _server_tool_calls(gen: Generation) -> list[dict]:
    """Tool calls a remote server parsed, as LangChain tool_call_chunk dicts."""
    return [{"name": call["name"], "args": call["arguments"], "id": call["id"], "index": call["index"],
             "type": "tool_call_chunk"} for call in getattr(gen, "tool_calls", ())]

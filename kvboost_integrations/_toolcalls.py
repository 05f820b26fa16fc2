"""The tool-call helpers, shared by both frameworks; they live in `kvboost_engine.toolcalls` (our
server uses them too) and are re-exported here for the adapters."""
from kvboost_engine.toolcalls import (FORMATS, HERMES, NO_ARGUMENTS, PYTHON_TAG, ToolCallSplitter, ToolFormat,
                                      add_tool_prompt, calls_as_text, forced_tools, native_call, native_call_id,
                                      new_call_id, normalize_tool_choice, tool_format, tool_prompt)

__all__ = ["FORMATS", "HERMES", "NO_ARGUMENTS", "PYTHON_TAG", "ToolCallSplitter", "ToolFormat", "add_tool_prompt",
           "calls_as_text", "forced_tools", "native_call", "native_call_id", "new_call_id", "normalize_tool_choice",
           "tool_format", "tool_prompt"]

"""LangChain's standard chat-model suites, subclassed (not rewritten).

The integration suite runs against the real default model (SmolLM2-135M-Instruct). Every
xfail names a limit of that 135M model, not a missing feature: tools, tool_choice,
structured output and usage metadata are all implemented and checked by the passing tests.
"""
import pytest

pytest.importorskip("langchain_tests")

from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from kvboost_engine import Engine  # noqa: E402
from kvboost_integrations.langchain import ChatKVBoost  # noqa: E402

SMALL_MODEL = "SmolLM2-135M-Instruct (135M parameters)"
UNPROMPTED_TOOLS = (f"{SMALL_MODEL} does not decide to call a tool on its own: its chat template has no "
                    "tool support and it was not trained to emit tool calls (forced tool calls pass)")


@pytest.fixture(scope="module")
def lc_engine(smol):
    model, tokenizer = smol
    return Engine(model, tokenizer, cache_bytes=256 * 2**20, model_name="SmolLM2-135M-Instruct")


class TestChatKVBoostUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self):
        return ChatKVBoost

    @property
    def standard_chat_model_params(self):
        params = super().standard_chat_model_params
        params.pop("api_key", None)      # a local engine has no API key (unknown arguments are errors)
        return params

    @property
    def supports_model_override(self):
        return False                 # one engine per instance: create another for another model


class TestChatKVBoostIntegration(ChatModelIntegrationTests):
    @pytest.fixture(autouse=True)
    def _share_test_engine(self, lc_engine):
        self._engine = lc_engine

    @property
    def chat_model_class(self):
        return ChatKVBoost

    @property
    def chat_model_params(self):
        # room for a forced tool call or a small JSON answer to finish (8 tokens cannot hold one;
        # constrained output is never closed early: it would end with finish_reason "length")
        return {"engine": self._engine, "max_tokens": 64}

    @property
    def supports_json_mode(self):
        return True

    @property
    def supports_model_override(self):
        return False

    @pytest.mark.xfail(reason=f"{SMALL_MODEL} does not copy Chinese or Japanese names into the arguments of a "
                              "forced call (it writes a Latin name); the call itself is valid", strict=False)
    def test_unicode_tool_call_integration(self, model, *, tool_choice="any", force_tool_call=True):
        super().test_unicode_tool_call_integration(model, tool_choice=tool_choice, force_tool_call=force_tool_call)

    @pytest.mark.xfail(reason=UNPROMPTED_TOOLS, strict=False)
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model):
        super().test_agent_loop(model)

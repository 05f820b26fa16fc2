"""LangChain's standard unit suite for ChatKVBoost with an endpoint (no request is sent)."""
import pytest

pytest.importorskip("langchain_tests")
pytest.importorskip("openai")

from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from kvboost_integrations.langchain import ChatKVBoost  # noqa: E402


class TestChatKVBoostRemoteUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self):
        return ChatKVBoost

    @property
    def chat_model_params(self):
        return {"endpoint": "http://127.0.0.1:9/v1", "served_model": "smollm2"}

    @property
    def supports_model_override(self):
        return False

"""Framework adapters (LangChain, LlamaIndex) on top of kvboost_engine."""

"""The fake OpenAI-compatible server the remote tests use; it lives in `kvboost_tools.fake_openai`
(importable by benchmarks too), with its faults in `kvboost_tools.fake_faults`."""
from kvboost_tools.fake_faults import MODES, Chaos, Fault  # noqa: F401
from kvboost_tools.fake_openai import FakeServer, render, tokens  # noqa: F401

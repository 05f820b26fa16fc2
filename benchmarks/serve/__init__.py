"""Serving benchmarks: our OpenAI-compatible server (kvboost_engine.serve) under load from several
client processes (`python -m benchmarks.serve.load --quick`)."""

"""The remote benchmark: our layout and routing on OpenAI-compatible servers (see remote.py)."""

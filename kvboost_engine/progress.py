"""A progress bar over the steps of a one-time job (converting a model), on stderr."""
from __future__ import annotations

import sys


class Stages:
    """A progress bar over the steps of a one-time job, on stderr (transformers' own bars nest inside)."""

    def __init__(self, title: str, steps: int):
        from tqdm import tqdm
        self.bar = tqdm(total=steps, desc=title, unit="step", file=sys.stderr, leave=True)

    def done(self, what: str) -> None:
        self.bar.set_postfix_str(what, refresh=False)
        self.bar.update(1)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()

"""One transformers model built at a time in this process (a lock around from_pretrained/from_config).

transformers builds a model under switches that are process-wide, not per thread: the default
dtype (`torch.set_default_dtype`), and attributes it swaps while it builds (`PreTrainedModel.
tie_weights` emptied, `torch.linspace`, the `torch.nn.init` functions). Each swap saves what it
finds and puts that back at the end, so two builds that overlap can save each other's swap and
put it back for good: two `Engine.from_pretrained` at once from two threads failed ("Cannot copy
out of meta tensor": the tied head was never tied) and every later load in the process failed
the same way. A process-wide lock is the only fix that does not depend on transformers' internals;
it costs concurrency only for the build itself (reading the weights), never for requests.

Only builds that kvboost starts take it; a caller's own concurrent transformers call can still
overlap ours.
"""
from __future__ import annotations

import contextlib
import threading

# Re-entrant: a build may call another helper that takes it (e.g. a conversion inside a load).
_BUILD_LOCK = threading.RLock()


@contextlib.contextmanager
def building_model():
    """Hold while transformers builds a model (from_pretrained, from_config)."""
    with _BUILD_LOCK:
        yield

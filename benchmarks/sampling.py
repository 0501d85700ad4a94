"""How many back-to-back calls make one timed sample, for both timing loops (jax_systems for JAX,
torch_peers for the torch peers), so that the two sides are sampled alike."""

from __future__ import annotations

import math

TARGET_SAMPLE_S = 0.01  # a sample lasts about this long
MAX_CALLS_PER_SAMPLE = 256
SLOW_CALL_S = 0.1  # calls this slow are warm after one run


def calls_per_sample(one_call_s: float) -> int:
    """Calls per sample for a call that takes ``one_call_s`` seconds."""
    return int(min(MAX_CALLS_PER_SAMPLE, max(1, math.ceil(TARGET_SAMPLE_S / max(one_call_s, 1e-7)))))

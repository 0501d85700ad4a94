"""Choosing an expert class for a layer: format, preference, then support checks."""

from __future__ import annotations

import os
from typing import Any

from .experts import EXPERT_CLASSES, FusedMoEExperts
from .ops.gemm import MIN_ROWS_PER_EXPERT
from .quant_keys import QuantKey

ENV_GEMM_TYPE = "HUMMING_JAX_MOE_GEMM_TYPE"
_STANDARD_CHOICES = ("indexed", "grouped", "auto")
# Auto picks the grouped class from this many expected rows per expert on (prefill): there the
# grouped GEMM runs the tiled wgmma kernel on Hopper (the kernel's own threshold), while fewer rows
# per expert stream weights best through the indexed class.
GROUPED_MIN_ROWS_PER_EXPERT = MIN_ROWS_PER_EXPERT


def _standard_preference(prefer: str | None) -> str:
    """The explicit argument first, then $HUMMING_JAX_MOE_GEMM_TYPE (read now), else auto."""
    if prefer is not None:
        choice, source = prefer, "prefer/gemm_type"
    else:
        choice, source = os.environ.get(ENV_GEMM_TYPE, "auto") or "auto", ENV_GEMM_TYPE
    choice = choice.strip().lower()
    if choice not in _STANDARD_CHOICES:
        raise ValueError(f"{source} = {choice!r} is not one of {list(_STANDARD_CHOICES)}")
    return choice


def select_experts(
    weight_key: QuantKey | None,
    act_key: QuantKey | None,
    activation: str = "silu",
    *,
    batched: bool = False,
    prefer: str | None = None,
    device: Any = None,
    rows_per_expert: float | None = None,
) -> type[FusedMoEExperts]:
    """Picks the expert class for a layer.

    ``batched=True`` picks among batched-format classes (``prefer`` may then be None, "auto" or
    "batched"). For the standard format an explicit ``prefer`` ("indexed" | "grouped" | "auto")
    wins, else ``$HUMMING_JAX_MOE_GEMM_TYPE``, else auto: the first supporting class in the order
    indexed, grouped, or grouped, indexed when ``rows_per_expert`` (the expected routed rows per
    local expert, M * top_k / E) is at least ``GROUPED_MIN_ROWS_PER_EXPERT``. A named class that
    cannot run the layer is an error, never a fallback; when nothing fits, the error says why each
    candidate was rejected.
    """
    fmt = "batched" if batched else "standard"
    candidates = [c for c in EXPERT_CLASSES if c.activation_format == fmt]
    if batched:
        choice = (prefer or "auto").strip().lower()
        names = [c.gemm_type for c in candidates]
        if choice not in names + ["auto"]:
            raise ValueError(f"prefer = {prefer!r} names no batched-format class; choose from {names + ['auto']}")
    else:
        choice = _standard_preference(prefer)
    if choice != "auto":
        candidates = [c for c in candidates if c.gemm_type == choice]
    elif not batched and rows_per_expert is not None and rows_per_expert >= GROUPED_MIN_ROWS_PER_EXPERT:
        candidates.sort(key=lambda c: c.gemm_type != "grouped")
    rejected = []
    for cls in candidates:
        reasons = cls.rejection_reasons(weight_key, act_key, activation, device)
        if not reasons:
            return cls
        rejected.append(f"{cls.__name__}: " + "; ".join(reasons))
    message = f"no {fmt}-format expert class can run this layer (preference {choice!r}):\n  " + "\n  ".join(rejected)
    if any("unsupported quant scheme" in r for r in rejected):
        from .schemas import supported_pairs_text

        message += "\nsupported (weight, activation) pairs:\n" + supported_pairs_text()
    raise ValueError(message)

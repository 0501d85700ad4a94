"""Choosing an expert class for a layer: format, preference, then support checks."""

from __future__ import annotations

import os
from typing import Any

from .experts import EXPERT_CLASSES, FusedMoEExperts
from .ops.gemm import MIN_ROWS_PER_EXPERT, RS4_MIN_ROWS_PER_EXPERT
from .quant_keys import GroupShape, QuantKey

ENV_GEMM_TYPE = "HUMMING_JAX_MOE_GEMM_TYPE"
_STANDARD_CHOICES = ("indexed", "grouped", "auto")
# Auto picks the grouped class from this many expected rows per expert on (prefill): there the
# grouped GEMM runs the tiled wgmma kernel on Hopper (the kernel's own threshold), while fewer rows
# per expert stream weights best through the indexed class.
GROUPED_MIN_ROWS_PER_EXPERT = MIN_ROWS_PER_EXPERT
# Weights our 4-bit mainloop takes with 16-bit activations (MXFP4; symmetric int4 with bf16 scales
# per whole 64-k groups or per row) run the grouped GEMM from RS4_MIN_ROWS_PER_EXPERT on: there its
# persistent forms stream the weights faster than the decode kernel (benchmarks/NOTES.md, v25, v27).
GROUPED_MIN_ROWS_PER_EXPERT_4BIT = RS4_MIN_ROWS_PER_EXPERT


def _rs4_weights(weight_key: QuantKey | None, act_key: QuantKey | None) -> bool:
    """Whether the layer's weights are a format the 4-bit mainloop takes (with 16-bit activations;
    the kernel takes bf16 ones, fp16 layers then run the decode kernel inside the grouped class)."""
    if weight_key is None or act_key is not None or weight_key.scale is None or weight_key.scale2 is not None:
        return False
    group = weight_key.scale.group_shape
    if weight_key.dtype == "float4_e2m1fn":
        return weight_key.scale.dtype == "float8_e8m0fnu" and group == GroupShape(1, 32)
    return (weight_key.dtype == "int4" and weight_key.symmetric and weight_key.scale.dtype == "bfloat16"
            and (group == GroupShape.PER_CHANNEL or (group.row == 1 and (group.col <= 0 or group.col % 64 == 0))))


def grouped_min_rows_per_expert(weight_key: QuantKey | None, act_key: QuantKey | None) -> int:
    """Expected rows per local expert from which auto selection prefers the grouped class."""
    return GROUPED_MIN_ROWS_PER_EXPERT_4BIT if _rs4_weights(weight_key, act_key) else GROUPED_MIN_ROWS_PER_EXPERT


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
    local expert, M * top_k / E) is at least ``grouped_min_rows_per_expert(weight_key, act_key)``
    (``GROUPED_MIN_ROWS_PER_EXPERT``; for 4-bit weights the 4-bit mainloop takes,
    ``GROUPED_MIN_ROWS_PER_EXPERT_4BIT``). A named class that cannot run the layer is an error,
    never a fallback; when nothing fits, the error says why each candidate was rejected.
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
    elif not batched and rows_per_expert is not None and rows_per_expert >= grouped_min_rows_per_expert(weight_key, act_key):
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

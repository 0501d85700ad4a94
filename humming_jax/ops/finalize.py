"""The finalize custom call: the weighted sum over top-k written into the caller's ``out``."""

from __future__ import annotations

import jax

from .. import _ffi


def finalize(d: jax.Array, topk_weights: jax.Array, src_rows: jax.Array, out: jax.Array) -> jax.Array:
    """out[t] = sum_j topk_weights[t, j] * d[src_rows[t, j]] (skipping src_rows < 0).

    The result aliases ``out`` (input 3): under donation it occupies out's buffer."""
    return _ffi.call(
        "finalize",
        jax.ShapeDtypeStruct(out.shape, out.dtype),
        d,
        topk_weights,
        src_rows,
        out,
        aliases={3: 0},
    )

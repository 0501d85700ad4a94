"""Loading the handler libraries and registering every custom call, in one place.

The CPU handlers live in the nanobind module ``humming_jax._humming_jax_cpu``; the CUDA handlers
in ``libhumming_jax_cuda.so``, a library without Python (so one build serves every Python
version), found in this package's folder or next to the CPU module; ``$HUMMING_JAX_CUDA_LIB``
names another build instead (then that file or none: a missing one is reported, never replaced).
Both register the same names, ``humming_jax.<call>``; XLA picks the handler by platform.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

PREFIX = "humming_jax."

# Every custom call; the CUDA library exports Hj<Camel>Cuda for each.
CALLS = (
    "routing_indexed",
    "routing_grouped",
    "permute_rows",
    "gemm_indexed",
    "gemm_indexed_quant",
    "gemm_indexed_gated",
    "experts_indexed",
    "experts_indexed_quant",
    "gemm_grouped",
    "gemm_grouped_gated",
    "gemm_grouped_gather",
    "gemm_batched",
    "gemm_batched_into",
    "activation",
    "activation_quant",
    "quantize",
    "quantize_permuted",
    "finalize",
    "layer_indexed",
    "layer_indexed_quant",
)

_state: dict[str, Any] = {"cpu": None, "cuda": None, "cuda_error": None, "cuda_path": None, "cuda_missing": []}


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _register_cpu() -> None:
    try:
        from . import _humming_jax_cpu  # type: ignore[attr-defined]
    except ImportError as exc:  # pragma: no cover - a broken install
        raise ImportError(
            "humming_jax: the CPU handler module _humming_jax_cpu is missing; "
            "install the package with `pip install -e .` (it builds the C++ library)"
        ) from exc
    regs = _humming_jax_cpu.registrations()
    missing = set(CALLS) - set(regs)
    if missing:
        raise ImportError(f"humming_jax: CPU module lacks handlers {sorted(missing)}")
    for name, capsule in regs.items():
        jax.ffi.register_ffi_target(PREFIX + name, capsule, platform="cpu")
    _state["cpu"] = Path(_humming_jax_cpu.__file__)


def _cuda_candidates(env: str | None) -> list[Path]:
    """Where the CUDA library may be: ``env`` ($HUMMING_JAX_CUDA_LIB) alone when set."""
    if env:  # an A/B run names its build: falling back to another would time the wrong one
        return [Path(env)]
    dirs = [Path(__file__).parent]
    if _state["cpu"] is not None:
        dirs.append(_state["cpu"].parent)
    return [d / "libhumming_jax_cuda.so" for d in dirs]


def _cuda_platform_present() -> bool:
    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:
        return False


def _register_cuda() -> None:
    """Registers the CUDA handlers when the library exists and JAX has a CUDA platform."""
    env = os.environ.get("HUMMING_JAX_CUDA_LIB")
    path = next((p for p in _cuda_candidates(env) if p.is_file()), None)
    if path is None:
        _state["cuda_error"] = (f"HUMMING_JAX_CUDA_LIB={env} is not a file" if env
                                else "libhumming_jax_cuda.so not built (no nvcc/GPU at build time)")
        return
    if not _cuda_platform_present():
        _state["cuda_error"] = f"{path} found, but JAX has no CUDA platform"
        return
    lib = ctypes.cdll.LoadLibrary(str(path))
    missing = [name for name in CALLS if not hasattr(lib, f"Hj{_camel(name)}Cuda")]
    if missing and not env:
        raise ImportError(f"humming_jax: {path} lacks the CUDA handlers of {missing}: rebuild it with the package")
    # A build named by $HUMMING_JAX_CUDA_LIB (an A/B run against an older revision) may predate some
    # calls: those stay unregistered on CUDA (a graph that uses one fails there) and the backend
    # report names them.
    for name in CALLS:
        if name not in missing:
            symbol = getattr(lib, f"Hj{_camel(name)}Cuda")
            jax.ffi.register_ffi_target(PREFIX + name, jax.ffi.pycapsule(symbol), platform="CUDA")
    _state["cuda"] = path
    _state["cuda_missing"] = missing


def register_all() -> None:
    """Registers the handlers once per process (called at import)."""
    if _state["cpu"] is None:
        _register_cpu()
        _register_cuda()


def cuda_available() -> bool:
    """True when the CUDA handlers are registered (library built and a CUDA device present)."""
    return _state["cuda"] is not None


def call_available(name: str) -> bool:
    """False only for a call that the CUDA library named by ``$HUMMING_JAX_CUDA_LIB`` (an A/B build
    of an older revision) lacks, so that callers with another way to the same result take it."""
    return name not in _state["cuda_missing"]


def backend_report() -> dict[str, str | None]:
    """Where each backend's handlers came from, or why CUDA is absent."""
    return {
        "cpu": str(_state["cpu"]) if _state["cpu"] else None,
        "cuda": str(_state["cuda"]) if _state["cuda"] else None,
        "cuda_unavailable_because": None if _state["cuda"] else _state["cuda_error"],
        "cuda_missing_calls": ", ".join(_state["cuda_missing"]) or None,
    }


def launch_counter(name: str) -> Any:
    """A uint64 launch counter exported by the CUDA library (e.g. ``HjDecodeLaunches``), as a
    callable, or None when the CUDA handlers or that symbol are absent. Tests and benchmarks use
    it to prove which kernel ran."""
    if _state["cuda"] is None:
        return None
    fn = getattr(ctypes.CDLL(str(_state["cuda"])), name, None)
    if fn is not None:
        fn.restype = ctypes.c_uint64
        fn.argtypes = []
    return fn


def call(
    name: str,
    results: Sequence[jax.ShapeDtypeStruct] | jax.ShapeDtypeStruct,
    *operands: jax.Array,
    aliases: dict[int, int] | None = None,
    **attrs: int | float,
) -> Any:
    """Issues custom call ``humming_jax.<name>``; ints become i64 and floats f32 attributes."""
    converted = {
        k: (np.float32(v) if isinstance(v, float) else int(v)) for k, v in attrs.items()
    }
    fn = jax.ffi.ffi_call(
        PREFIX + name,
        results,
        input_output_aliases=aliases or {},
        vmap_method="sequential",
    )
    return fn(*operands, **converted)

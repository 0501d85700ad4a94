"""Loading MoE layers from safetensors checkpoints, and the converted (kernel-format) store.

``load_moe_layer(path_or_dir, prefix)`` reads one MoE layer's experts and returns ``MoEWeights``
through ``convert_to_kernel_format``. Reading is lazy: files are opened with
``safetensors.safe_open`` (headers only), and the layer is read, converted and placed one expert at
a time into preallocated device arrays (updated in place), so a layer never needs twice its
memory — at most the kernel-format layer plus one expert's checkpoint tensors.

Naming conventions (``prefix`` is the MoE block, e.g. ``model.layers.3.mlp``; a trailing
``.experts`` is accepted too):

per-expert (Qwen-MoE, DeepSeek, Mixtral in transformers' naming)
    ``{prefix}.experts.{e}.gate_proj|up_proj|down_proj.<tensor>``, or Mixtral's original
    ``{prefix}.experts.{e}.w1|w3|w2.<tensor>`` (w1 = gate, w3 = up, w2 = down). Gate and up are
    concatenated along N (gate rows first). ``<tensor>`` is any layout ``convert_to_kernel_format``
    accepts: GPTQ/AWQ ``qweight, scales, qzeros, g_idx``; compressed-tensors ``weight_packed,
    weight_scale, weight_zero_point, weight_shape, weight_g_idx``; FP8 ``weight,
    weight_scale_inv | weight_scale``; NVFP4 ``weight, weight_scale, weight_scale_2``; INT8 and
    unquantized ``weight`` (+ ``weight_scale``); MXFP4 ``blocks, scales``; every layout may carry
    ``bias``. Static activation scales (``input_scale``, ...) are not read.
fused (gpt-oss)
    ``{prefix}.experts.gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16], ``gate_up_proj_scales``
    uint8 e8m0 [E, 2I, H/32], ``gate_up_proj_bias`` [E, 2I], ``down_proj_blocks`` [E, H, I/32, 16],
    ``down_proj_scales``, ``down_proj_bias`` [E, H] (MXFP4); or the dequantized
    ``gate_up_proj`` [E, H, 2I] and ``down_proj`` [E, I, H] (input dimension first). gpt-oss
    interleaves gate and up rows (gate = rows 0, 2, 4, ...; up = rows 1, 3, 5, ...), which is the
    ``swigluoai`` layout, so a fused layer defaults to ``activation="swigluoai"``.

The activation fixes the w13 row order: ``swigluoai`` wants interleaved rows, the other gated
activations gate-then-up halves. When the stored order differs (``gate_up_order``), rows are
reordered, which needs one scale per row (unpacked N): MXFP4, NVFP4, INT8, per-channel or
per-tensor FP8, unquantized, and GPTQ's ``qweight``/``scales`` without zero points.

The schema comes from ``config.json``'s ``quantization_config`` when not given (see
``schema_from_config``). Missing or unreadable tensors raise ``CheckpointError`` naming the
tensor and the file.

The converted store (``convert_checkpoint``, ``load_converted``, the ``convert``/``load`` command
line) holds one safetensors file per MoE layer with the ``MoEWeights`` leaves as they are
(``experts.w13.data``, ``experts.w13.scale``, ... and the router as ``router.weight``), and a
JSON file ``humming_jax_moe.json`` with each layer's file, scheme, dtype, activation and shapes.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from . import schemas as sc
from ._abi import WeightType
from .activations import ACTIVATIONS, ActivationCode, get_activation
from .conversion import convert_to_kernel_format
from .quantize import SCHEMES, quantize_moe_weights
from .weights import MoEWeights, PackedWeight

__all__ = [
    "CheckpointError",
    "METADATA_FILE",
    "convert_checkpoint",
    "converted_layers",
    "discover_moe_layers",
    "load_converted",
    "load_moe_layer",
    "load_router_weight",
    "read_tensor",
    "schema_from_config",
    "write_converted_layer",
]

METADATA_FILE = "humming_jax_moe.json"
FORMAT = "humming-jax-moe"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, unreadable or inconsistent; the message names it and its file."""


# --- safetensors files ------------------------------------------------------------------------
# dtypes that safetensors' NumPy reader cannot produce (it looks them up on numpy itself): read
# from the byte range the header gives, as ml_dtypes arrays.
_RAW_DTYPES = {
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
if hasattr(ml_dtypes, "float8_e8m0fnu"):
    _RAW_DTYPES["F8_E8M0"] = np.dtype(ml_dtypes.float8_e8m0fnu)


def _safe_open(path: Path) -> Any:
    try:
        from safetensors import safe_open
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("reading checkpoints needs the safetensors package: pip install 'humming-jax[checkpoint]'") from err
    return safe_open(str(path), framework="numpy")


class _File:
    """One safetensors file, opened lazily; tensors are read whole or one index of axis 0."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle: Any = None
        self._header: dict[str, Any] | None = None
        self._keys: set[str] | None = None

    def _open(self, tensor: str | None) -> Any:
        if self._handle is None:
            try:
                self._handle = _safe_open(self.path).__enter__()
            except ImportError:
                raise
            except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
                what = f"tensor {tensor!r}: " if tensor else ""
                raise CheckpointError(f"{what}cannot open safetensors file {self.path}: {err}") from err
        return self._handle

    def keys(self) -> set[str]:
        if self._keys is None:
            self._keys = set(self._open(None).keys())
        return self._keys

    def _raw_header(self) -> dict[str, Any]:
        if self._header is None:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                self._header = json.loads(f.read(n))
                self._header["__data_start__"] = 8 + n
        return self._header

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype string, shape) of a tensor, from the header."""
        try:
            view = self._open(name).get_slice(name)
            return str(view.get_dtype()), tuple(int(d) for d in view.get_shape())
        except CheckpointError:
            raise
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(f"tensor {name!r} in {self.path}: cannot read its header entry: {err}") from err

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        """The tensor, or its slice ``[index]`` along axis 0, as a NumPy array."""
        dtype, shape = self.info(name)
        if index is not None and (not shape or not 0 <= index < shape[0]):
            raise CheckpointError(f"tensor {name!r} in {self.path} has shape {list(shape)}; cannot take index {index} of axis 0")
        try:
            if dtype in _RAW_DTYPES:
                return self._read_raw(name, _RAW_DTYPES[dtype], shape, index)
            view = self._open(name).get_slice(name)
            arr = view[index] if index is not None else self._open(name).get_tensor(name)
            return np.asarray(arr)
        except CheckpointError:
            raise
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(f"tensor {name!r} in {self.path}: cannot read it ({dtype} {list(shape)}): {err}") from err

    def _read_raw(self, name: str, dtype: np.dtype, shape: tuple[int, ...], index: int | None) -> np.ndarray:
        entry = self._raw_header().get(name)
        start, end = entry["data_offsets"]
        count = int(np.prod(shape, dtype=np.int64))
        if end - start != count * dtype.itemsize:
            raise CheckpointError(
                f"tensor {name!r} in {self.path}: its byte range ({end - start} bytes) does not hold {list(shape)} x {dtype}"
            )
        base = self._raw_header()["__data_start__"] + start
        if index is not None:
            row = count // shape[0]
            base, count, shape = base + index * row * dtype.itemsize, row, shape[1:]
        with open(self.path, "rb") as f:
            f.seek(base)
            data = f.read(count * dtype.itemsize)
        if len(data) != count * dtype.itemsize:
            raise CheckpointError(f"tensor {name!r} in {self.path}: the file ends inside the tensor's data (truncated file)")
        return np.frombuffer(data, dtype=dtype).reshape(shape).copy()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
            self._handle = None


class _Checkpoint:
    """A checkpoint: one .safetensors file, or a directory of them (with or without an index)."""

    def __init__(self, path_or_dir: str | os.PathLike[str]) -> None:
        path = Path(path_or_dir)
        if not path.exists():
            raise FileNotFoundError(f"checkpoint {path} does not exist")
        self.root = path if path.is_dir() else path.parent
        self.where = str(path)
        self._files: dict[Path, _File] = {}
        self.names: dict[str, Path] = {}
        if path.is_file():
            for key in self._file(path).keys():
                self.names[key] = path
        else:
            indexes = sorted(path.glob("*.safetensors.index.json"))
            if indexes:
                self.where = str(indexes[0])
                try:
                    weight_map = json.loads(indexes[0].read_text())["weight_map"]
                except (OSError, ValueError, KeyError) as err:
                    raise CheckpointError(f"cannot read the index {indexes[0]}: {err}") from err
                self.names = {k: path / v for k, v in weight_map.items()}
            else:
                files = sorted(path.glob("*.safetensors"))
                if not files:
                    raise FileNotFoundError(f"no .safetensors files in {path}")
                for f in files:
                    for key in self._file(f).keys():
                        self.names[key] = f
        self.config = _read_config(self.root)

    def _file(self, path: Path) -> _File:
        if path not in self._files:
            self._files[path] = _File(path)
        return self._files[path]

    def has(self, name: str) -> bool:
        return name in self.names

    def file_of(self, name: str, near: str | None = None) -> Path:
        if name not in self.names:
            hint = ""
            if near is not None and near in self.names:
                hint = f" (its neighbour {near!r} is in {self.names[near]})"
            raise CheckpointError(f"missing tensor {name!r} in checkpoint {self.where}{hint}")
        return self.names[name]

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        return self._file(self.file_of(name)).info(name)

    def read(self, name: str, index: int | None = None, near: str | None = None) -> np.ndarray:
        path = self.file_of(name, near)
        if not path.exists():
            raise CheckpointError(f"tensor {name!r}: its file {path} (from {self.where}) does not exist")
        f = self._file(path)
        try:
            keys = f.keys()
        except CheckpointError as err:
            raise CheckpointError(f"tensor {name!r}: {err}") from err
        if name not in keys:
            raise CheckpointError(f"missing tensor {name!r}: not in {path} (where {self.where} places it)")
        return f.read(name, index)

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> "_Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _read_config(root: Path) -> dict[str, Any]:
    cfg = root / "config.json"
    if not cfg.exists():
        return {}
    try:
        return json.loads(cfg.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot parse {cfg}: {err}") from err


def read_tensor(path_or_dir: str | os.PathLike[str], name: str) -> np.ndarray:
    """One tensor of a checkpoint (file or directory) as a NumPy array."""
    with _Checkpoint(path_or_dir) as ckpt:
        return ckpt.read(name)


# --- schemas from config.json -----------------------------------------------------------------
def _float_dtype(config: Mapping[str, Any]) -> Any:
    name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return jnp.float16 if name in ("float16", "half") else jnp.bfloat16


def _ct_group(qc: Mapping[str, Any], module: str | None) -> Mapping[str, Any] | None:
    """The compressed-tensors config group whose targets cover ``module`` (None: ignored)."""
    for pattern in qc.get("ignore") or ():
        if module is not None and (pattern == module or (pattern.startswith("re:") and re.match(pattern[3:], module))):
            return None
    groups = list((qc.get("config_groups") or {}).values())
    for g in groups:
        for target in g.get("targets") or ():
            if target == "Linear" or (module is not None and (target == module or (target.startswith("re:") and re.match(target[3:], module)))):
                return g
    if len(groups) == 1:
        return groups[0]
    raise ValueError(f"compressed-tensors config: no config group targets {module!r}; groups: {groups}")


def _ct_input(act: Mapping[str, Any] | None) -> Any:
    if not act:
        return sc.NoInputQuant()
    bits, kind, strategy = act.get("num_bits"), act.get("type"), act.get("strategy")
    if bits == 8 and kind == "float":
        if strategy == "group":
            return sc.FP8Dynamic(int(act.get("group_size") or 128))
        return sc.FP8Dynamic()  # token; a static per-tensor scale is replaced by dynamic per-token scales
    if bits == 8 and kind == "int":
        return sc.Int8Dynamic()
    raise ValueError(f"compressed-tensors input_activations {dict(act)} are not supported")


def _ct_schema(qc: Mapping[str, Any], module: str | None, config: Mapping[str, Any]) -> tuple[Any, Any]:
    group = _ct_group(qc, module)
    if group is None:
        return sc.Unquantized(_float_dtype(config)), sc.NoInputQuant()
    w = group.get("weights") or {}
    fmt = group.get("format") or qc.get("format") or ""
    bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    inp = _ct_input(group.get("input_activations"))
    if kind == "int":
        if fmt in ("int-quantized", "naive-quantized"):
            if bits != 8:
                raise ValueError(f"compressed-tensors {fmt} with {bits}-bit weights is not supported")
            return sc.Int8(per_channel=strategy != "tensor"), inp
        group_size = int(w.get("group_size") or -1) if strategy == "group" else -1
        return sc.GPTQ(int(bits), group_size, sym=bool(w.get("symmetric", True))), inp
    if kind == "float" and bits == 8:
        if strategy == "block":
            return sc.FP8(block=tuple(w.get("block_structure") or (128, 128))), inp
        return (sc.FP8(per_tensor=True) if strategy == "tensor" else sc.FP8()), inp
    raise ValueError(
        f"compressed-tensors weights {dict(w)} (format {fmt!r}) are not supported; supported: int 4/8-bit "
        "pack-quantized, int8 int-quantized, fp8 float-quantized"
    )


def schema_from_config(config: Mapping[str, Any], module: str | None = None) -> tuple[Any, Any]:
    """(weight schema, input schema) from a model's ``config.json`` (its ``quantization_config``).

    Keys read, by ``quant_method``:

    - none (no ``quantization_config``): ``Unquantized`` in ``torch_dtype`` (or ``dtype``;
      float16 stays float16, anything else is bfloat16), 16-bit activations.
    - ``gptq``: ``bits``, ``group_size``, ``sym`` (default True), ``desc_act`` (True is rejected),
      ``checkpoint_format`` (only ``gptq``, i.e. v1, is accepted).
    - ``awq``: ``bits``, ``group_size``, ``zero_point`` (default True), ``version`` (``gemm``).
    - ``fp8``: ``weight_block_size`` ([128, 128] -> ``FP8(block=...)`` with fp8 activations per
      128-group; absent -> ``FP8(per_tensor=True)`` with fp8 activations per token).
      ``activation_scheme`` is not read: activations are always quantized dynamically.
    - ``compressed-tensors``: ``format``, ``ignore`` (names or ``re:`` patterns; a match means
      unquantized), and the config group whose ``targets`` cover ``module`` (or ``Linear``):
      ``weights.num_bits/type/strategy/group_size/symmetric/block_structure`` and
      ``input_activations.num_bits/type/strategy/group_size`` (static scales become dynamic).
    - ``mxfp4``: ``MXFP4`` with 16-bit activations.
    - ``modelopt``: ``quant_algo`` (also under ``quantization``): ``NVFP4`` -> ``NVFP4``, 16-bit
      activations; ``FP8`` -> ``FP8(per_tensor=True)`` with fp8 activations per token.
    """
    qc = config.get("quantization_config")
    if not qc:
        return sc.Unquantized(_float_dtype(config)), sc.NoInputQuant()
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt != "gptq":
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (only 'gptq', i.e. v1)")
        return (
            sc.GPTQ(int(qc.get("bits", 4)), int(qc.get("group_size", 128)), sym=bool(qc.get("sym", True)),
                    desc_act=bool(qc.get("desc_act", False))),
            sc.NoInputQuant(),
        )
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (only the GEMM layout)")
        return sc.AWQ(int(qc.get("bits", 4)), int(qc.get("group_size", 128)), bool(qc.get("zero_point", True))), sc.NoInputQuant()
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block:
            block = tuple(int(b) for b in block)
            return sc.FP8(block=block), sc.FP8Dynamic(block[1])
        return sc.FP8(per_tensor=True), sc.FP8Dynamic()
    if method == "compressed-tensors":
        return _ct_schema(qc, module, config)
    if method == "mxfp4":
        return sc.MXFP4(), sc.NoInputQuant()
    if method == "modelopt":
        algo = str(qc.get("quant_algo") or (qc.get("quantization") or {}).get("quant_algo") or "").upper()
        if algo == "NVFP4":
            return sc.NVFP4(), sc.NoInputQuant()
        if algo == "FP8":
            return sc.FP8(per_tensor=True), sc.FP8Dynamic()
        raise ValueError(f"modelopt quant_algo {algo!r} is not supported (NVFP4, FP8)")
    raise ValueError(f"quantization_config quant_method {method!r} is not supported")


# --- layer layouts ----------------------------------------------------------------------------
_PROJ_NAMES = {"hf": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
_IGNORED = frozenset({"input_scale", "input_scale_inv", "input_global_scale", "input_zero_point"})
_SHARED = frozenset({"g_idx", "weight_g_idx"})
_GPTQ_LIKE_LAST_AXIS = frozenset({"qweight", "scales", "qzeros"})
_FUSED_MXFP4 = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")


def _base(prefix: str) -> str:
    p = prefix.rstrip(".")
    if p.endswith(".experts"):
        p = p[: -len(".experts")]
    return p


@dataclass
class _Layout:
    """How one MoE layer is stored."""

    kind: str  # "per_expert" | "fused_mxfp4" | "fused_float"
    base: str  # "{prefix}.experts."
    num_experts: int
    order: str  # stored w13 row order: "halves" | "interleaved"
    proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    suffixes: tuple[str, ...] = ()  # per-expert tensor suffixes
    down_suffixes: tuple[str, ...] = ()
    gated: bool = True
    fused: dict[str, str] = field(default_factory=dict)


def _find_layout(ckpt: _Checkpoint, prefix: str, gate_up_order: str | None) -> _Layout:
    base = _base(prefix) + ".experts."
    names = [n for n in ckpt.names if n.startswith(base)]
    if not names:
        found = discover_moe_layers(ckpt)
        raise CheckpointError(
            f"no tensors named {base}* in checkpoint {ckpt.where}; MoE layers found: {found or 'none'}"
        )
    if gate_up_order not in (None, "halves", "interleaved"):
        raise ValueError(f"gate_up_order must be None, 'halves' or 'interleaved', got {gate_up_order!r}")
    rest = [n[len(base):] for n in names]
    if any(r in ("gate_up_proj_blocks", "gate_up_proj") for r in rest):
        kind = "fused_mxfp4" if "gate_up_proj_blocks" in rest else "fused_float"
        if kind == "fused_mxfp4":
            fused = {k: base + k for k in _FUSED_MXFP4}
        else:
            fused = {"gate_up_proj": base + "gate_up_proj", "down_proj": base + "down_proj"}
        for k in ("gate_up_proj_bias", "down_proj_bias"):
            if base + k in ckpt.names:
                fused[k] = base + k
        for k, name in fused.items():
            ckpt.file_of(name, near=base + ("gate_up_proj_blocks" if kind == "fused_mxfp4" else "gate_up_proj"))
        _, shape = ckpt.info(fused["down_proj_blocks" if kind == "fused_mxfp4" else "down_proj"])
        return _Layout(kind, base, int(shape[0]), gate_up_order or "interleaved", fused=fused)
    pat = re.compile(r"^(\d+)\.([A-Za-z0-9_]+)\.(.+)$")
    experts: dict[int, dict[str, set[str]]] = {}
    for r in rest:
        m = pat.match(r)
        if m:
            experts.setdefault(int(m.group(1)), {}).setdefault(m.group(2), set()).add(m.group(3))
    if not experts:
        raise CheckpointError(f"tensors under {base} in {ckpt.where} follow no known naming: e.g. {names[:3]}")
    projs = set().union(*(p.keys() for p in experts.values()))
    style = "mixtral" if {"w1", "w2"} & projs and not {"gate_proj", "down_proj"} & projs else "hf"
    gate, up, down = _PROJ_NAMES[style]
    gated = gate in projs
    e_count = max(experts) + 1
    p0 = experts.get(0, {})
    w13_name = gate if gated else up
    suffixes = tuple(sorted(s for s in p0.get(w13_name, ()) if s not in _IGNORED))
    down_suffixes = tuple(sorted(s for s in p0.get(down, ()) if s not in _IGNORED))
    if not suffixes or not down_suffixes:
        missing = f"{base}0.{w13_name if not suffixes else down}.*"
        raise CheckpointError(f"missing tensors {missing} in checkpoint {ckpt.where}")
    return _Layout("per_expert", base, e_count, gate_up_order or "halves", (gate, up, down), suffixes, down_suffixes, gated)


def discover_moe_layers(path_or_ckpt: Any) -> list[str]:
    """The MoE block prefixes of a checkpoint (per-expert or fused naming), in layer order."""
    ckpt = path_or_ckpt if isinstance(path_or_ckpt, _Checkpoint) else _Checkpoint(path_or_ckpt)
    found = set()
    pat = re.compile(r"^(.*)\.experts\.(?:\d+\.(?:gate_proj|up_proj|w1)\.|gate_up_proj(?:_blocks)?$)")
    for name in ckpt.names:
        m = pat.match(name)
        if m:
            found.add(m.group(1))

    def natural(s: str) -> list[Any]:
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]

    return sorted(found, key=natural)


# --- reading one expert -----------------------------------------------------------------------
@dataclass
class _Expert:
    """One expert's checkpoint tensors, with the E axis of length 1, under canonical names."""

    w13: dict[str, np.ndarray]
    w2: dict[str, np.ndarray]
    sources: dict[tuple[str, str], list[tuple[str, Path]]]  # (w13|w2, canonical) -> [(name, file)]


def _merge(suffix: str, g: np.ndarray, u: np.ndarray, gname: str, uname: str, gptq_like: bool) -> np.ndarray:
    """gate and up tensors of one expert -> the w13 tensor (gate rows first)."""
    if suffix in _SHARED:
        if not np.array_equal(g, u):
            raise CheckpointError(f"tensors {gname!r} and {uname!r} differ; the gate and up projections must share them")
        return g
    if suffix == "weight_shape":
        gs, us = np.asarray(g).reshape(-1), np.asarray(u).reshape(-1)
        if gs[1] != us[1]:
            raise CheckpointError(f"tensors {gname!r} and {uname!r} give different input sizes K: {gs.tolist()} vs {us.tolist()}")
        return np.array([gs[0] + us[0], gs[1]], dtype=gs.dtype)
    if suffix == "weight_scale_2":
        return np.concatenate([g.reshape(-1)[:1], u.reshape(-1)[:1]])
    axis = -1 if (gptq_like and suffix in _GPTQ_LIKE_LAST_AXIS) else 0
    if g.ndim == 0 or g.shape != u.shape:
        raise CheckpointError(
            f"tensors {gname!r} {list(g.shape)} and {uname!r} {list(u.shape)} cannot be joined along N (axis {axis}): "
            "the gate and up projections must have the same shape"
        )
    if g.dtype != u.dtype:
        raise CheckpointError(f"tensors {gname!r} ({g.dtype}) and {uname!r} ({u.dtype}) differ in dtype")
    return np.concatenate([g, u], axis=axis)


def _read_expert(ckpt: _Checkpoint, lay: _Layout, e: int, per_tensor_fp8: str) -> _Expert:
    sources: dict[tuple[str, str], list[tuple[str, Path]]] = {}

    def read(which: str, canon: str, name: str, index: int | None = None, near: str | None = None) -> np.ndarray:
        arr = ckpt.read(name, index, near)
        sources.setdefault((which, canon), []).append((name, ckpt.names[name]))
        return arr

    if lay.kind != "per_expert":
        f = lay.fused
        w13: dict[str, np.ndarray] = {}
        w2: dict[str, np.ndarray] = {}
        if lay.kind == "fused_mxfp4":
            w13["blocks"] = read("w13", "blocks", f["gate_up_proj_blocks"], e)
            w13["scales"] = read("w13", "scales", f["gate_up_proj_scales"], e)
            w2["blocks"] = read("w2", "blocks", f["down_proj_blocks"], e)
            w2["scales"] = read("w2", "scales", f["down_proj_scales"], e)
        else:  # stored [in, out]: transpose to [N, K]
            w13["weight"] = np.ascontiguousarray(read("w13", "weight", f["gate_up_proj"], e).T)
            w2["weight"] = np.ascontiguousarray(read("w2", "weight", f["down_proj"], e).T)
        if "gate_up_proj_bias" in f:
            w13["bias"] = read("w13", "bias", f["gate_up_proj_bias"], e)
        if "down_proj_bias" in f:
            w2["bias"] = read("w2", "bias", f["down_proj_bias"], e)
        return _Expert({k: v[None] for k, v in w13.items()}, {k: v[None] for k, v in w2.items()}, sources)

    gate, up, down = lay.proj
    gptq_like = "qweight" in lay.suffixes
    anchor = f"{lay.base}{e}.{lay.proj[0] if lay.gated else up}.{lay.suffixes[0]}"
    w13 = {}
    for s in lay.suffixes:
        un = f"{lay.base}{e}.{up}.{s}"
        if lay.gated:
            gn = f"{lay.base}{e}.{gate}.{s}"
            g = read("w13", s, gn, near=anchor)
            u = read("w13", s, un, near=anchor)
            if s == "weight_scale" and per_tensor_fp8 != "no":
                w13[s] = _fp8_tensor_scale(g, u, gn, un, per_tensor_fp8, ckpt, lay, e)
            else:
                try:
                    w13[s] = _merge(s, g, u, gn, un, gptq_like)
                except CheckpointError as err:
                    files = sorted({str(ckpt.names[gn]), str(ckpt.names[un])})
                    raise CheckpointError(f"{err} (in {', '.join(files)})") from err
        else:
            w13[s] = read("w13", s, un, near=anchor)
    w2 = {}
    for s in lay.down_suffixes:
        dn = f"{lay.base}{e}.{down}.{s}"
        w2[s] = read("w2", s, dn, near=anchor)
        if s == "weight_scale" and per_tensor_fp8 == "expand":
            rows = ckpt.info(f"{lay.base}{e}.{down}.weight")[1][0]
            w2[s] = np.full((rows,), float(w2[s].reshape(-1)[0]), np.float32)
    return _Expert({k: v[None] for k, v in w13.items()}, {k: v[None] for k, v in w2.items()}, sources)


def _fp8_tensor_scale(g: np.ndarray, u: np.ndarray, gn: str, un: str, mode: str, ckpt: _Checkpoint, lay: _Layout, e: int) -> np.ndarray:
    """Per-tensor FP8 scales of gate and up: one scale when they agree (mode "same"); otherwise
    (mode "expand") one scale per row, exact, so the layer runs as per-channel FP8."""
    if g.size != 1 or u.size != 1:
        raise CheckpointError(f"per-tensor FP8 needs one scale per tensor; {gn!r} is {list(g.shape)}, {un!r} {list(u.shape)}")
    if mode == "same":
        return g.reshape(1).astype(np.float32)
    gate, up, _ = lay.proj
    n_g = ckpt.info(f"{lay.base}{e}.{gate}.weight")[1][0]
    n_u = ckpt.info(f"{lay.base}{e}.{up}.weight")[1][0]
    return np.concatenate([np.full((n_g,), float(g.reshape(-1)[0]), np.float32), np.full((n_u,), float(u.reshape(-1)[0]), np.float32)])


def _per_tensor_fp8_mode(ckpt: _Checkpoint, lay: _Layout, schema: Any) -> str:
    """"no" unless the schema is per-tensor FP8 with per-expert naming; then "same" when every
    expert's gate and up scales agree, else "expand" (the layer becomes per-channel FP8)."""
    if not (isinstance(schema, sc.FP8) and schema.per_tensor and lay.kind == "per_expert" and lay.gated):
        return "no"
    gate, up, _ = lay.proj
    for e in range(lay.num_experts):
        g = ckpt.read(f"{lay.base}{e}.{gate}.weight_scale")
        u = ckpt.read(f"{lay.base}{e}.{up}.weight_scale")
        if g.size == 1 and u.size == 1 and float(g.reshape(-1)[0]) != float(u.reshape(-1)[0]):
            return "expand"
    return "same"


# --- w13 row order ----------------------------------------------------------------------------
def _row_perm(n1: int, src: str, dst: str) -> np.ndarray | None:
    if src == dst:
        return None
    i = n1 // 2
    halves_from_interleaved = np.concatenate([np.arange(0, n1, 2), np.arange(1, n1, 2)])
    if src == "interleaved":  # -> halves
        return halves_from_interleaved
    return np.stack([np.arange(i), np.arange(i) + i], axis=1).reshape(-1)  # halves -> interleaved


def _reorder_rows(w13: dict[str, np.ndarray], perm: np.ndarray, gptq_like: bool, where: str) -> dict[str, np.ndarray]:
    """Applies a permutation of w13's N rows to every tensor with an N axis (axis 1 after E)."""
    n1 = perm.size
    out = {}
    for name, a in w13.items():
        if name in _SHARED or name in ("weight_shape", "weight_scale_2") or a.ndim < 2 or a.size == a.shape[0]:
            out[name] = a
            continue
        axis = a.ndim - 1 if (gptq_like and name in _GPTQ_LIKE_LAST_AXIS) else 1
        if a.shape[axis] != n1:
            raise CheckpointError(
                f"{where}: tensor {name!r} {list(a.shape[1:])} has {a.shape[axis]} entries along N, not one per row "
                f"({n1}), so the gate/up rows cannot be reordered for this activation; pass gate_up_order or "
                "another activation"
            )
        out[name] = np.take(a, perm, axis=axis)
    return out


# --- loading a layer --------------------------------------------------------------------------
@partial(jax.jit, donate_argnums=0)
def _put(buf: jax.Array, value: jax.Array, e: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(buf, value.astype(buf.dtype), e, axis=0)


_CONFIG_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                       "gelu_new": "gelu_tanh", "relu2": "relu2_no_mul"}


def _default_activation(lay: _Layout, config: Mapping[str, Any]) -> str:
    if lay.order == "interleaved":
        return "swigluoai"
    act = _CONFIG_ACTIVATIONS.get(str(config.get("hidden_act", "silu")), "silu")
    if lay.gated != ACTIVATIONS[act].gated:
        return "silu" if lay.gated else "relu2_no_mul"
    return act


def _convert_expert(ex: _Expert, schema: Any, input_schema: Any, activation: str, dtype: Any, where: str) -> MoEWeights:
    try:
        return convert_to_kernel_format(ex.w13, ex.w2, schema, input_schema, activation, dtype=dtype)
    except (ValueError, TypeError) as err:
        msg = str(err)
        quoted = set(re.findall(r"'([A-Za-z0-9_]+)'", msg))
        which = msg.split(":", 1)[0] if msg.startswith(("w13:", "w2:")) else None
        hits = [src for (w, canon), srcs in ex.sources.items() for src in srcs if canon in quoted and (which in (None, w))]
        if not hits:
            hits = [src for srcs in ex.sources.values() for src in srcs]
        listing = ", ".join(f"{name!r} in {path}" for name, path in hits)
        raise CheckpointError(f"{where}: {msg} (checkpoint tensors: {listing})") from err


def load_moe_layer(
    path_or_dir: str | os.PathLike[str],
    prefix: str,
    weight_schema: Any = None,
    *,
    input_schema: Any = None,
    activation: str | None = None,
    dtype: Any = None,
    scheme: str | None = None,
    gate_up_order: str | None = None,
    progress: bool = False,
) -> MoEWeights:
    """One MoE layer of a safetensors checkpoint as ``MoEWeights`` in kernel format.

    ``path_or_dir``: a ``.safetensors`` file, or a directory of them (with a
    ``*.safetensors.index.json`` or without), or a directory written by ``convert_checkpoint``.
    ``prefix``: the MoE block, e.g. ``model.layers.0.mlp`` (see the module docstring for the
    naming conventions). ``weight_schema`` / ``input_schema``: the checkpoint's format; when
    ``weight_schema`` is None both come from ``config.json`` (``schema_from_config``; a layer
    stored as plain float ``weight``/``gate_up_proj`` tensors is read as unquantized whatever the
    config says). ``activation``: fixes the w13 layout (None: ``swigluoai`` for interleaved
    gate/up, i.e. gpt-oss, else the config's ``hidden_act``, else ``silu``). ``dtype``: the
    activation dtype (the config's for unquantized layers, else bfloat16). ``scheme``: a name of
    ``humming_jax.SCHEMES`` to re-quantize to, expert by expert (None: keep the stored format).
    ``gate_up_order``: how the checkpoint orders w13 rows, "halves" or "interleaved" (None:
    interleaved for fused tensors, halves for per-expert ones). ``progress``: a tqdm bar.

    Raises ``CheckpointError`` (a ValueError) naming the tensor and file for missing, unreadable
    or inconsistent tensors, and the converter's errors with the checkpoint tensors they concern.
    """
    path = Path(path_or_dir)
    if path.is_dir() and (path / METADATA_FILE).exists():
        return load_converted(path, prefix)
    if scheme is not None and scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; supported: {sorted(SCHEMES)}")
    with _Checkpoint(path) as ckpt:
        lay = _find_layout(ckpt, prefix, gate_up_order)
        if activation is None:
            activation = _default_activation(lay, ckpt.config)
        spec, _ = get_activation(activation)
        if spec.gated != lay.gated:
            raise ValueError(
                f"activation {activation!r} is {'gated' if spec.gated else 'not gated'} but {lay.base}* holds "
                f"{'gate and up' if lay.gated else 'no gate'} projections"
            )
        want_order = "interleaved" if spec.code == ActivationCode.SWIGLUOAI else "halves"
        float_only = (lay.kind == "fused_float") or (lay.kind == "per_expert" and set(lay.suffixes) <= {"weight", "bias"}
                                                     and ckpt.info(f"{lay.base}0.{lay.proj[2]}.weight")[0] in ("BF16", "F16", "F32"))
        if weight_schema is None:
            if float_only:
                weight_schema, default_input = sc.Unquantized(_float_dtype(ckpt.config)), sc.NoInputQuant()
            else:
                weight_schema, default_input = schema_from_config(ckpt.config, f"{lay.base}0.{lay.proj[0]}")
            input_schema = default_input if input_schema is None else input_schema
        fp8_mode = _per_tensor_fp8_mode(ckpt, lay, weight_schema)
        if fp8_mode == "expand":
            weight_schema = sc.FP8()  # gate and up scales differ: per-row scales represent both exactly
        if isinstance(weight_schema, sc.Unquantized) and dtype is not None:
            weight_schema = sc.Unquantized(dtype)
        gptq_like = "qweight" in lay.suffixes
        e_total = lay.num_experts
        steps: Iterable[int] = range(e_total)
        if progress:
            from tqdm import tqdm

            steps = tqdm(steps, desc=_base(prefix), unit="expert", leave=True)
        bufs: list[jax.Array] | None = None
        treedef = None
        for e in steps:
            where = f"{lay.base}{e}" if lay.kind == "per_expert" else f"{lay.base[:-1]} (expert {e})"
            ex = _read_expert(ckpt, lay, e, fp8_mode)
            perm = _row_perm(next(iter(_n_rows(ex.w13, gptq_like))), lay.order, want_order) if lay.gated else None
            if perm is not None:
                ex.w13 = _reorder_rows(ex.w13, perm, gptq_like, where)
            w = _convert_expert(ex, weight_schema, input_schema, activation, dtype, where)
            if scheme is not None and scheme != w.scheme:
                d13, d2 = w.dequantize()
                # 16-bit target schemes fix their own dtype; the others keep the layer's.
                target_dtype = dtype if dtype is not None else (w.dtype if SCHEMES[scheme].weight_key.quantized else None)
                w = quantize_moe_weights(np.asarray(d13), np.asarray(d2), scheme, dtype=target_dtype, b13=w.b13, b2=w.b2)
            leaves, tdef = jax.tree.flatten(w)
            if bufs is None:
                treedef = tdef
                bufs = [jnp.zeros((e_total,) + leaf.shape[1:], leaf.dtype) for leaf in leaves]
            elif tdef != treedef:
                raise CheckpointError(f"{where}: converts to a different format than expert 0 ({tdef} vs {treedef})")
            for j, leaf in enumerate(leaves):
                if leaf.shape[1:] != bufs[j].shape[1:]:
                    raise CheckpointError(f"{where}: a converted array is {leaf.shape[1:]}, expert 0's is {bufs[j].shape[1:]}")
                bufs[j] = _put(bufs[j], leaf, jnp.int32(e))
        return jax.tree.unflatten(treedef, bufs)


def _n_rows(w13: Mapping[str, np.ndarray], gptq_like: bool) -> Iterable[int]:
    """N1 of an expert's w13 tensors: the largest extent along an N axis."""
    sizes = []
    for name, a in w13.items():
        if name in _SHARED or name in ("weight_shape", "weight_scale_2") or a.ndim < 2:
            continue
        sizes.append(a.shape[a.ndim - 1 if (gptq_like and name in _GPTQ_LIKE_LAST_AXIS) else 1])
    return [max(sizes)]


def load_router_weight(path_or_dir: str | os.PathLike[str], prefix: str) -> tuple[np.ndarray, np.ndarray | None]:
    """The router of an MoE block: (weight [E, H], bias [E] or None) as float32.

    Looks for ``{prefix}.gate.weight`` (Qwen-MoE, Mixtral, DeepSeek) and ``{prefix}.router.weight``
    (+ ``.bias``, gpt-oss); in a converted directory, the layer's ``router.weight``. For
    ``HummingMoE.from_weights`` pass ``weight.T`` (Flax kernels are [in, out])."""
    path = Path(path_or_dir)
    base = _base(prefix)
    if path.is_dir() and (path / METADATA_FILE).exists():
        meta = _layer_meta(path, base)
        f = _File(path / meta["file"])
        try:
            names = f.keys()
            if "router.weight" not in names:
                raise CheckpointError(f"missing tensor 'router.weight' in {f.path} (layer {base} was converted without a router)")
            bias = f.read("router.bias").astype(np.float32) if "router.bias" in names else None
            return f.read("router.weight").astype(np.float32), bias
        finally:
            f.close()
    with _Checkpoint(path) as ckpt:
        for name in (f"{base}.gate.weight", f"{base}.router.weight"):
            if ckpt.has(name):
                bias_name = name[: -len("weight")] + "bias"
                bias = ckpt.read(bias_name).astype(np.float32) if ckpt.has(bias_name) else None
                return ckpt.read(name).astype(np.float32), bias
        raise CheckpointError(f"missing tensor {base}.gate.weight or {base}.router.weight in checkpoint {ckpt.where}")


# --- the converted store ----------------------------------------------------------------------
_LEAF_NAMES = ("w13.data", "w13.scale", "w13.zero", "w13.scale2", "w2.data", "w2.scale", "w2.zero", "w2.scale2", "b13", "b2")


def _leaves_by_name(w: MoEWeights) -> dict[str, jax.Array | None]:
    return {
        "w13.data": w.w13.data, "w13.scale": w.w13.scale, "w13.zero": w.w13.zero, "w13.scale2": w.w13.scale2,
        "w2.data": w.w2.data, "w2.scale": w.w2.scale, "w2.zero": w.w2.zero, "w2.scale2": w.w2.scale2,
        "b13": w.b13, "b2": w.b2,
    }


def _packed_meta(p: PackedWeight) -> dict[str, Any]:
    return {"wtype": p.wtype.name, "k": p.k, "group_n": p.group_n, "group_k": p.group_k}


def _layer_file_name(prefix: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", prefix) + ".safetensors"


def write_converted_layer(dst: str | os.PathLike[str], prefix: str, weights: MoEWeights, *, activation: str,
                          router: tuple[np.ndarray, np.ndarray | None] | None = None) -> dict[str, Any]:
    """Writes one layer (and optionally its router) into a converted directory; returns its
    metadata entry (``convert_checkpoint`` collects them into ``humming_jax_moe.json``)."""
    from safetensors.numpy import save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {f"experts.{k}": np.asarray(v) for k, v in _leaves_by_name(weights).items() if v is not None}
    if router is not None:
        tensors["router.weight"] = np.asarray(router[0], np.float32)
        if router[1] is not None:
            tensors["router.bias"] = np.asarray(router[1], np.float32)
    name = _layer_file_name(prefix)
    save_file(tensors, str(dst / name), metadata={"format": FORMAT, "prefix": prefix})
    return {
        "file": name,
        "scheme": weights.scheme,
        "dtype": jnp.dtype(weights.dtype).name,
        "activation": activation,
        "num_experts": weights.num_experts,
        "hidden_size": weights.hidden_size,
        "intermediate_size": weights.intermediate_size,
        "weight_key": str(weights.weight_key),
        "act_key": str(weights.act_key) if weights.act_key is not None else "16-bit",
        "w13": _packed_meta(weights.w13),
        "w2": _packed_meta(weights.w2),
        "tensors": sorted(tensors),
        "router": router is not None,
    }


def convert_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    scheme: str | None = None,
    layers: Iterable[str] | None = None,
    weight_schema: Any = None,
    input_schema: Any = None,
    activation: str | None = None,
    dtype: Any = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Converts a checkpoint's MoE layers (all found by ``discover_moe_layers``, or ``layers``)
    to kernel format under ``dst``: one safetensors file per layer (experts and router) and
    ``humming_jax_moe.json``. ``scheme`` re-quantizes (None: keep the stored format); the other
    arguments are ``load_moe_layer``'s. Returns the metadata written."""
    dst = Path(dst)
    prefixes = list(layers) if layers is not None else discover_moe_layers(src)
    if not prefixes:
        raise CheckpointError(f"no MoE layers found in checkpoint {src}")
    entries: dict[str, Any] = {}
    for prefix in prefixes:
        base = _base(prefix)
        with _Checkpoint(src) as ckpt:
            lay = _find_layout(ckpt, base, None)
            act = activation or _default_activation(lay, ckpt.config)
        weights = load_moe_layer(src, base, weight_schema, input_schema=input_schema, activation=act, dtype=dtype,
                                 scheme=scheme, progress=progress)
        try:
            router = load_router_weight(src, base)
        except CheckpointError:
            router = None
        entries[base] = write_converted_layer(dst, base, weights, activation=act, router=router)
        del weights
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "source": str(src), "layers": entries}
    (dst / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def converted_layers(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The layers of a converted directory: prefix -> metadata (file, scheme, dtype, activation, shapes)."""
    meta_path = Path(path) / METADATA_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {meta_path}: {err}") from err
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path} is not a {FORMAT} v{FORMAT_VERSION} file")
    return meta["layers"]


def _layer_meta(path: Path, prefix: str) -> dict[str, Any]:
    layers = converted_layers(path)
    if prefix not in layers:
        raise CheckpointError(f"no layer {prefix!r} in {path / METADATA_FILE}; layers: {sorted(layers)}")
    return layers[prefix]


def load_converted(path: str | os.PathLike[str], prefix: str) -> MoEWeights:
    """One layer of a directory written by ``convert_checkpoint`` as ``MoEWeights``."""
    path = Path(path)
    base = _base(prefix)
    meta = _layer_meta(path, base)
    scheme = meta["scheme"]
    if scheme not in SCHEMES:
        raise CheckpointError(f"layer {base!r} in {path / METADATA_FILE} has unknown scheme {scheme!r}")
    f = _File(path / meta["file"])
    try:
        if not f.path.exists():
            raise CheckpointError(f"layer {base!r}: its file {f.path} does not exist")
        names = set(f.keys())
        arrays: dict[str, jax.Array | None] = {}
        for leaf in _LEAF_NAMES:
            key = f"experts.{leaf}"
            if key in meta["tensors"] and key not in names:
                raise CheckpointError(f"missing tensor {key!r} in {f.path}")
            arrays[leaf] = jnp.asarray(f.read(key)) if key in names else None
    finally:
        f.close()

    def packed(which: str) -> PackedWeight:
        m = meta[which]
        return PackedWeight(arrays[f"{which}.data"], arrays[f"{which}.scale"], arrays[f"{which}.zero"], arrays[f"{which}.scale2"],
                            WeightType[m["wtype"]], int(m["k"]), int(m["group_n"]), int(m["group_k"]))

    spec = SCHEMES[scheme]
    weights = MoEWeights(packed("w13"), packed("w2"), arrays["b13"], arrays["b2"], spec.weight_key, spec.act_key, scheme,
                         jnp.dtype(meta["dtype"]))
    got = (weights.num_experts, weights.hidden_size, weights.intermediate_size)
    want = (meta["num_experts"], meta["hidden_size"], meta["intermediate_size"])
    if got != want:
        raise CheckpointError(f"layer {base!r} in {f.path}: tensors give (E, H, I) = {got}, the metadata says {want}")
    return weights

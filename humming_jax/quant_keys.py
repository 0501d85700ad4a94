"""Quantization keys: what a tensor's codes and scales are, independent of any checkpoint format.

``GroupShape(row, col)`` gives the extent of one scale along the N (row) and K (col) dimensions of
a weight, or along tokens (row) and K (col) of an activation; -1 (or 0) means the whole dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class GroupShape:
    row: int
    col: int

    PER_TENSOR: ClassVar["GroupShape"]
    PER_TOKEN: ClassVar["GroupShape"]
    PER_CHANNEL: ClassVar["GroupShape"]

    def __repr__(self) -> str:
        for name in ("PER_TENSOR", "PER_TOKEN", "PER_CHANNEL"):
            if self == getattr(GroupShape, name):
                return f"GroupShape.{name}"
        return f"GroupShape({self.row}, {self.col})"

    def extent(self, rows: int, cols: int) -> tuple[int, int]:
        """The group's size in elements for a [rows, cols] tensor (-1 and 0 mean whole)."""
        return (rows if self.row <= 0 else self.row, cols if self.col <= 0 else self.col)


GroupShape.PER_TENSOR = GroupShape(-1, -1)
GroupShape.PER_TOKEN = GroupShape(1, -1)
GroupShape.PER_CHANNEL = GroupShape(-1, 1)


@dataclass(frozen=True)
class ScaleDesc:
    """A scale: its dtype name, whether it is fixed ahead (static) or computed per call, its group."""

    dtype: str
    static: bool
    group_shape: GroupShape


@dataclass(frozen=True)
class QuantKey:
    """A quantized tensor's code dtype and scales. ``scale`` is None for unquantized tensors."""

    dtype: str
    scale: ScaleDesc | None = None
    scale2: ScaleDesc | None = None
    symmetric: bool = True

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    def __str__(self) -> str:
        if self.scale is None:
            return self.dtype
        parts = [self.dtype, f"scale={self.scale.dtype}/{self.scale.group_shape!r}"]
        parts.append("static" if self.scale.static else "dynamic")
        if self.scale2 is not None:
            parts.append(f"scale2={self.scale2.dtype}")
        if not self.symmetric:
            parts.append("zero-point")
        return "(" + ", ".join(parts) + ")"


def describe_pair(weight_key: QuantKey | None, act_key: QuantKey | None) -> str:
    """A short readable name for a (weight, activation) key pair, used in error messages."""
    w = str(weight_key) if weight_key is not None else "None"
    a = str(act_key) if act_key is not None else "16-bit"
    return f"weights {w} with activations {a}"

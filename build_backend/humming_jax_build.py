"""The package's build backend: scikit-build-core, plus the CUTLASS headers (the nvidia-cutlass
wheel) as a build requirement exactly when the build will compile the CUDA library with its sm_90a
fast paths. The CPU build never downloads them. Mirrors CMakeLists.txt's HUMMING_JAX_CUDA=AUTO
test: nvcc present and a GPU listed by nvidia-smi (or HUMMING_JAX_CUDA=ON)."""

from __future__ import annotations

import os
import shutil
import subprocess

from scikit_build_core import build as _skbuild
from scikit_build_core.build import (  # noqa: F401  (the PEP 517 hooks passed through)
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

CUTLASS_REQUIREMENT = "nvidia-cutlass>=4.2,<5"


def _flag(name: str, default: str) -> str:
    return (os.environ.get(name, default) or default).strip().upper()


def _cuda_build() -> bool:
    mode = _flag("HUMMING_JAX_CUDA", "AUTO")
    if mode in ("ON", "1", "TRUE"):
        return True
    if mode not in ("AUTO", ""):
        return False
    nvcc = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") or None)
    smi = shutil.which("nvidia-smi")
    if not (nvcc and smi):
        return False
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def _extra() -> list[str]:
    fast = _flag("HUMMING_JAX_FAST_PATHS", "ON") in ("ON", "1", "TRUE")
    needs = fast and _cuda_build() and not os.environ.get("HUMMING_JAX_CUTLASS_DIR")
    return [CUTLASS_REQUIREMENT] if needs else []


def get_requires_for_build_wheel(config_settings=None):
    return [*_skbuild.get_requires_for_build_wheel(config_settings), *_extra()]


def get_requires_for_build_editable(config_settings=None):
    return [*_skbuild.get_requires_for_build_editable(config_settings), *_extra()]

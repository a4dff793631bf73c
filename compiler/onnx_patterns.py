"""Decomposed attention in an imported Relax module → tvmattn kernels (tvm.relax.dpl patterns)."""

from __future__ import annotations

import tvm
from tvm import relax

from .relax_attention import Kernels


def rewrite(mod: tvm.IRModule, kernels: Kernels, provenance: dict) -> tvm.IRModule:
    return mod


def remaining_softmax(mod: tvm.IRModule, provenance: dict) -> list[str]:
    return []

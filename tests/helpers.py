"""Test helpers: one compile per (spec, target, knobs) for the whole session."""

from __future__ import annotations

import functools

import tvmattn
from tvmattn.compiler.kernel import CompiledAttention
from tvmattn.compiler.spec import AttentionSpec


@functools.lru_cache(maxsize=64)
def compiled(spec: AttentionSpec, target: str = "cpu", knobs: tuple = ()) -> CompiledAttention:
    return tvmattn.compile(spec, target, knobs=dict(knobs) or None)

"""The contract every attention schedule rule keeps (TVM dlight's `ScheduleRule` is the model).

A rule is tried for a (spec, target) pair; `schedules.rule_for` takes the first in its target's list
that applies. It declares its knob space once (``KNOBS``: split factors, or template shapes), so the
default build, a tuning record and MetaSchedule's design space all go through the same `apply`:
the default build passes integers, MetaSchedule the random variables of ``sample_categorical``. It
declares the passes its kernels need after scheduling (``passes``), and it may try kernel families
of its own in turn (`KernelRule`).
"""

from __future__ import annotations

from typing import Mapping

import tvm
from tvm.s_tir import Schedule
from tvm.target import Target
from tvm.tirx import PrimFunc

from tvmattn.compiler.passes import skip_masked_key_tiles
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.te_attention import attention_te
from tvmattn.schedules.knobs import Knob, KnobValue


class AttentionRule:
    """One way to schedule the attention of a spec on a target kind."""

    name: str  # stored in tuning records: a record is used only by the rule that measured it
    target_kind: str | None = None  # the TVM target kind it schedules (None: every kind)
    KNOBS: tuple[Knob, ...] = ()

    def applies(self, spec: AttentionSpec, target: Target) -> bool:
        """Whether this rule schedules ``spec`` on ``target``: by default, the attention output on
        its target kind."""
        return target.kind.name == self.target_kind and spec.output == "attn"

    def defaults(self, spec: AttentionSpec, target: Target) -> dict[str, int]:
        """Knob defaults that depend on the spec and the target (beyond each knob's own default)."""
        return {}

    def workload(self, spec: AttentionSpec, target: Target, knobs: Mapping[str, KnobValue]) -> PrimFunc:
        """The PrimFunc this rule schedules: the tensor expression's, unless the rule has a template."""
        return attention_te(spec).prim_func()

    def apply(self, sch: Schedule, spec: AttentionSpec, target: Target,
              knobs: Mapping[str, KnobValue]) -> Schedule | None:
        """Schedule ``sch`` (of `workload`'s function for ``knobs``); None when the rule does not apply."""
        raise NotImplementedError

    def describe(self, spec: AttentionSpec, target: Target, knobs: Mapping[str, KnobValue]) -> str:
        """The kernel `apply` builds, in words, with the knobs it reads."""
        raise NotImplementedError

    def passes(self, spec: AttentionSpec, target: Target) -> list[tvm.transform.Pass]:
        """The passes its kernels need after scheduling, before TVM's pipeline: by default the key tiles
        the mask hides removed."""
        return [skip_masked_key_tiles(spec)]


class KernelRule:
    """One kernel family of a target's rule (a query-tile kernel, split-K decode, …), as TVM dlight's
    rules are: tried in order on the rule's plan of the kernel, the first that schedules it wins."""

    name: str

    def apply(self, sch: Schedule, plan, knobs: Mapping[str, KnobValue], later: list) -> Schedule | None:
        """Schedule ``sch`` as ``plan`` says (its tensorize steps appended to ``later``, run last); None
        when the plan is not of this family."""
        raise NotImplementedError

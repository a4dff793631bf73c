"""tvmattn's TIR passes: masked key tiles are skipped (loops tightened), exp is a vectorisable polynomial."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from helpers import assert_matches_oracle, compiled

from tvmattn import AttentionSpec, schedules
from tvmattn.compiler import passes
from tvmattn.compiler.build import lower, schedule_attention
from tvmattn.compiler.target import resolve_target

CPU = resolve_target("cpu")


def _scheduled(spec):
    sch, _ = schedules.schedule(spec, CPU)
    return sch.mod


def _loop_extents(mod):
    found = []
    tvm_ffi.structural_walk(mod["main"].body, [(tvm.tirx.For, lambda f: found.append(f.extent))])
    return found


def test_causal_key_loops_depend_on_the_query_tile():
    spec = AttentionSpec(seq_len=64, num_heads=1, head_dim=16, causal=True, projections=False)
    before = _scheduled(spec)
    after = passes.skip_masked_key_tiles(spec)(before)
    constant = lambda es: sum(isinstance(e, tvm.tirx.IntImm) for e in es)  # noqa: E731
    # every key loop (scores, row_max, probs, row_sum, pv) became an expression of the query tile
    assert constant(_loop_extents(after)) <= constant(_loop_extents(before)) - 5
    assert "T.min" in after.script()


def test_no_mask_no_change():
    spec = AttentionSpec(seq_len=32, num_heads=1, head_dim=16, projections=False)
    mod = _scheduled(spec)
    tvm.ir.assert_structural_equal(passes.skip_masked_key_tiles(spec)(mod), mod)


def test_symbolic_key_length_is_guarded_not_resized():
    spec = AttentionSpec(seq_len="n", num_heads=1, head_dim=16, causal=True, projections=False)
    after = passes.skip_masked_key_tiles(spec)(_scheduled(spec))
    assert "sees_keys" in after.script()


def test_tile_buffers_never_hold_the_score_matrix():
    """Per task the scores live in a q_tile × n_kv tile, not the n × n_kv matrix (4 MiB here)."""
    spec = AttentionSpec(seq_len=1024, num_heads=2, head_dim=64, causal=True, projections=False)
    mod, _ = schedule_attention(spec, CPU)
    lowered = lower(mod, CPU).script()
    sizes = [int(line.split("((")[1].split(",")[0].rstrip(")"))
             for line in lowered.splitlines() if "T.alloc_buffer((" in line]
    assert sizes and max(sizes) <= 64 * 1024  # a tile of at most 64 queries × 1024 keys
    assert max(sizes) < 1024 * 1024


def test_polynomial_exp_accuracy():
    x = tvm.te.placeholder((4096,), "float32", "x")
    y = tvm.te.compute(x.shape, lambda i: tvm.tirx.exp(x[i]), name="y")
    mod = tvm.IRModule({"main": tvm.te.create_prim_func([x, y])})
    mod = passes.polynomial_exp()(mod)
    assert "T.exp" not in mod.script()
    f = tvm.compile(mod, CPU)
    xs = np.linspace(-87, 0, 4096).astype(np.float32)
    out = tvm.runtime.empty((4096,), "float32", tvm.cpu())
    f(tvm.runtime.tensor(xs), out)
    rel = np.abs(out.numpy() - np.exp(xs.astype(np.float64))) / np.exp(xs.astype(np.float64))
    assert rel.max() < 1e-6


@pytest.mark.parametrize("field", [dict(causal=True), dict(window=5), dict(key_padding=True)])
def test_skipping_keeps_results(field):
    """Each mask kind with the pass on equals the oracle (the pass is on in every build)."""
    spec = AttentionSpec(batch=2, seq_len=77, num_heads=2, head_dim=16, projections=False, **field)
    assert_matches_oracle(compiled(spec))

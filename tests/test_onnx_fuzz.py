"""Imported models under hostile input: never a crash, a hang, another exception type or a different answer.

Every mutant (`onnx_fuzz`) runs in a sandboxed worker and must end as one clean TvmAttnError line or
agree with ONNX Runtime / ONNX's reference evaluator. The default run draws a seeded few; ``-m slow``
runs the campaign (``TVMATTN_FUZZ_MUTANTS``, default 300) and prints its table.
"""

from __future__ import annotations

import collections
import itertools
import os
import random

import numpy as np
import onnx
import onnx_fuzz
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx_testing import ort_run

import tvmattn
from tvmattn.models import onnx_models

FINE = {"clean error", "agrees", onnx_fuzz.OUT_OF_RANGE}  # the last tallied apart: see OVERFLOW_SCALE


@pytest.fixture(scope="module")
def sandbox():
    box = onnx_fuzz.Sandbox(timeout_s=180)
    yield box
    box.close()


@pytest.fixture(scope="module")
def bases():
    return onnx_fuzz.base_models()


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(base=st.sampled_from(sorted(onnx_fuzz.base_models())), kind=st.sampled_from(onnx_fuzz.MUTATIONS),
       seed=st.integers(0, 2**16))
def test_a_mutant_is_a_clean_error_or_the_reference_answer(sandbox, bases, base, kind, seed):
    model, feed = bases[base]
    mutant = onnx_fuzz.mutate(base, model, feed, kind, random.Random(seed))
    verdict, detail = sandbox.run(mutant)
    assert verdict in FINE, f"{base} {kind} ({mutant.note}): {verdict} {detail}"


@pytest.mark.slow
def test_fuzz_campaign(sandbox, bases):
    """The campaign of the issue: at least 300 mutants, every verdict tallied per mutation kind."""
    rng = random.Random(int(os.environ.get("TVMATTN_FUZZ_SEED", "0")))
    tally: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures = []
    for _ in range(int(os.environ.get("TVMATTN_FUZZ_MUTANTS", "300"))):
        base, kind = rng.choice(sorted(bases)), rng.choice(onnx_fuzz.MUTATIONS)
        mutant = onnx_fuzz.mutate(base, *bases[base], kind, rng)
        verdict, detail = sandbox.run(mutant)
        tally[kind][verdict] += 1
        if verdict not in FINE:
            failures.append(f"{base} {kind} ({mutant.note}): {verdict} {detail}")
    verdicts = sorted({v for c in tally.values() for v in c})
    print("\n| mutation | " + " | ".join(verdicts) + " |\n|---|" + "---|" * len(verdicts))
    for kind in onnx_fuzz.MUTATIONS:
        print(f"| {kind} | " + " | ".join(str(tally[kind][v]) for v in verdicts) + " |")
    assert not failures, "\n".join(failures)


# ---- the matcher's proof: a mutated element of a matched pattern is refused or still right ---------
def _transposes(model: onnx.ModelProto) -> list[str]:
    return [n.name for n in model.graph.node if n.op_type == "Transpose"]


def _with_perm(model: onnx.ModelProto, node: str, perm: tuple[int, ...]) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    target = next(n for n in out.graph.node if n.name == node)
    attr = next(a for a in target.attribute if a.name == "perm")
    del attr.ints[:]
    attr.ints.extend(perm)
    return out


BERT = onnx_models.bert_block(d_model=16, heads=2)  # d_k = 8 = n below: most permutations stay shape-valid
BERT_FEED = {"x": np.random.default_rng(1).standard_normal((1, 8, 16)).astype(np.float32),
             "attention_mask": np.array([[1] * 7 + [0]], np.int64)}
PERMUTED = [(node, perm) for node in _transposes(BERT) for perm in itertools.permutations(range(4))
            if list(perm) != list(next(a for a in next(n for n in BERT.graph.node if n.name == node).attribute
                                       if a.name == "perm").ints)]


@pytest.mark.parametrize("node, perm", PERMUTED[::9] + [("Transpose_31", (0, 3, 1, 2))])
def test_a_permuted_transpose_is_refused_or_computed_as_written(node, perm):
    _assert_refused_or_equal(_with_perm(BERT, node, perm))


@pytest.mark.slow
@pytest.mark.parametrize("node, perm", PERMUTED)
def test_every_permuted_transpose_is_refused_or_computed_as_written(node, perm):
    _assert_refused_or_equal(_with_perm(BERT, node, perm))


def _assert_refused_or_equal(model: onnx.ModelProto) -> None:
    try:
        want = ort_run(model, BERT_FEED)
    except Exception:  # ONNX Runtime refuses it: so must we
        with pytest.raises(tvmattn.TvmAttnError):
            tvmattn.import_onnx(model).run(BERT_FEED)
        return
    try:
        got = tvmattn.import_onnx(model).run(BERT_FEED)
    except tvmattn.TvmAttnError:
        return
    for g, w in zip(got, want):
        assert np.max(np.abs(g - w)) <= 1e-4 * np.max(np.abs(w)), "a rewrite changed what the graph computes"


def test_a_product_with_a_second_consumer_keeps_its_layout():
    """P·V also read elsewhere (T5's TorchScript export reads its shape for the head merge): the kernel's
    BSHD output must be permuted back where it stands in for the (B, h, n, d_v) product."""
    model = onnx.ModelProto()
    model.CopyFrom(BERT)
    merge = next(n for n in model.graph.node if n.name == "Transpose_31")
    model.graph.output.append(onnx.helper.make_tensor_value_info(merge.input[0], onnx.TensorProto.FLOAT, [1, 2, 8, 8]))
    got, want = tvmattn.import_onnx(model).run(BERT_FEED), ort_run(model, BERT_FEED)
    for g, w in zip(got, want):
        assert g.shape == w.shape and np.max(np.abs(g - w)) <= 1e-4 * np.max(np.abs(w))


# ---- each class of the issue, one line each ------------------------------------------------------
def _attention_node(domain: str, op: str, **attrs) -> onnx.ModelProto:
    from onnx import TensorProto, helper
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4, 8]) for n in "qkv"]
    node = helper.make_node(op, ["q", "k", "v"], ["o"], name=f"{op}_0", domain=domain, **attrs)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("o", TensorProto.FLOAT, [1, 4, 8])])
    opsets = [helper.make_opsetid("", 23)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=opsets)


@pytest.mark.parametrize("model, names", [
    (_attention_node("", "Attention", is_causal=5, q_num_heads=2, kv_num_heads=2), "is_causal=5"),
    (_attention_node("com.microsoft", "MultiHeadAttention", num_heads=0), "num_heads=0"),
    (_attention_node("com.microsoft", "MultiHeadAttention", num_heads=2, unidirectional=-1), "unidirectional=-1"),
])
def test_an_out_of_spec_attribute_is_an_error_naming_node_and_attribute(model, names):
    with pytest.raises(tvmattn.TvmAttnError, match=names) as err:
        tvmattn.import_onnx(model)
    assert "_0" in str(err.value) and "\n" not in str(err.value)


def test_an_out_of_range_gather_index_is_an_error_not_a_read_out_of_bounds():
    model = tvmattn.import_onnx(onnx_fuzz._embedding_model())
    assert np.array_equal(model.run({"ids": np.array([[9, -1]])})[0], model.run({"ids": np.array([[9, 9]])})[0])
    for ids in ([[10]], [[-11]], [[2**40]]):
        with pytest.raises(tvmattn.TvmAttnError, match=r"Gather_0.*\[-10, 9\]"):
            model.run({"ids": np.array(ids)})


@pytest.mark.parametrize("count", [1, 15, 17, 1000])
def test_a_long_gather_index_is_checked_in_every_chunk(count):
    """The run-time check runs in parallel chunks: an index out of range in the first, a middle or the
    last chunk is the node's error, and every index is mapped (negative ones from the end)."""
    model = tvmattn.import_onnx(onnx_fuzz._embedding_model())
    ids = np.random.default_rng(count).integers(-10, 10, (1, count))
    table = np.arange(80, dtype=np.float32).reshape(10, 8) / 80  # the model's
    assert np.array_equal(model.run({"ids": ids})[0], table[ids % 10])
    for at in {0, count // 2, count - 1}:
        bad = ids.copy()
        bad[0, at] = 10
        with pytest.raises(tvmattn.TvmAttnError, match=r"Gather_0.*\[-10, 9\]"):
            model.run({"ids": bad})


def test_an_out_of_range_gather_elements_index_is_an_error_not_a_read_out_of_bounds():
    """GatherElements (DeBERTa's relative positions, torch.gather): TVM's kernel read past the axis (a
    segfault); the index is checked, negative ones counted from the end, as ONNX Runtime does."""
    graph = onnx.helper.make_graph([onnx.helper.make_node("GatherElements", ["x", "i"], ["y"], axis=1)], "g",
                              [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4]),
                               onnx.helper.make_tensor_value_info("i", onnx.TensorProto.INT64, [2, "k"])],
                              [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, "k"])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    imported = tvmattn.import_onnx(model)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    index = np.array([[0, 3, -1], [-4, 2, 1]])
    assert np.array_equal(imported.run({"x": x, "i": index})[0], np.take_along_axis(x, index % 4, axis=1))
    for bad in (4, -5, 2**40):
        with pytest.raises(tvmattn.TvmAttnError, match=r"GatherElements.*\[-4, 3\]"):
            imported.run({"x": x, "i": np.array([[0, 1, bad], [0, 0, 0]])})


@pytest.mark.parametrize("batch_dims", [0, 1])
def test_an_out_of_range_gather_nd_index_is_an_error_not_a_read_out_of_bounds(batch_dims):
    """GatherND (dynamo's W[expert_ids] in a mixture of experts): TVM's kernel read past the data (garbage,
    or a segfault); each coordinate of an index tuple is checked against its axis, negative ones counted
    from the end, as ONNX Runtime does. x is (2, 3, 5): tuples of 2 index (3, 5) below batch 2 with
    batch_dims=1, (2, 3) without."""
    x = np.arange(30, dtype=np.float32).reshape(2, 3, 5)
    extents = x.shape[batch_dims:batch_dims + 2]
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("GatherND", ["x", "i"], ["y"], batch_dims=batch_dims)], "g",
        [onnx.helper.make_tensor_value_info("i", onnx.TensorProto.INT64, [2, "k", 2])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, "k"] if batch_dims
                                            else [2, "k", 5])],
        initializer=[onnx.numpy_helper.from_array(x, "x")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    imported = tvmattn.import_onnx(model)
    index = np.array([[[0, 1], [-1, -extents[1]], [1, 2]], [[-extents[0], 0], [1, -1], [0, 0]]])
    np.testing.assert_array_equal(imported.run({"i": index})[0], ort_run(model, {"i": index})[0])
    for j, bad in ((0, extents[0]), (1, -extents[1] - 1), (1, 2**40)):
        wrong = index.copy()
        wrong[1, 2, j] = bad
        with pytest.raises(tvmattn.TvmAttnError, match=rf"GatherND_0' \(GatherND\): coordinate {j} .*"
                                                        rf"\[-{extents[j]}, {extents[j]}\)"):
            imported.run({"i": wrong})
        # bound at import (a static import folds the indices into a constant): checked there
        with pytest.raises(tvmattn.TvmAttnError, match=rf"GatherND.*index {bad} is out of range"):
            tvmattn.import_onnx(_with_constant(model, "i", wrong))
    np.testing.assert_array_equal(tvmattn.import_onnx(_with_constant(model, "i", index)).run({})[0],
                                  ort_run(model, {"i": index})[0])


def _with_constant(model: onnx.ModelProto, name: str, value: np.ndarray) -> onnx.ModelProto:
    """``model`` with its input ``name`` an initializer holding ``value``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [i for i in out.graph.input if i.name != name]
    del out.graph.input[:]
    out.graph.input.extend(kept)
    out.graph.initializer.append(onnx.numpy_helper.from_array(value.astype(np.int64), name))
    return out


@pytest.mark.parametrize("n", [3, 16, 37])
def test_a_small_table_lookup_fuses_into_its_transposition_and_keeps_its_check(n):
    """T5's bias: a (32 buckets, 4 heads) table gathered by an (n, n) bucket map, then heads first. The
    lookup is fused into the transposition (no (n, n, 4) tensor between them), its indices checked."""
    table = np.random.default_rng(2).standard_normal((32, 4)).astype(np.float32)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Gather", ["table", "buckets"], ["bias"], axis=0),
         onnx.helper.make_node("Transpose", ["bias"], ["y"], perm=[2, 0, 1])], "g",
        [onnx.helper.make_tensor_value_info("buckets", onnx.TensorProto.INT64, ["n", "n"])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, "n", "n"])],
        initializer=[onnx.numpy_helper.from_array(table, "table")])
    imported = tvmattn.import_onnx(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]))
    assert [name for name in imported.report.rule_of if "take" in name] == ["fused_take_transpose"]
    buckets = np.random.default_rng(3).integers(-32, 32, (n, n))
    assert np.array_equal(imported.run({"buckets": buckets})[0], table[buckets % 32].transpose(2, 0, 1))
    buckets[n - 1, n - 1] = 32
    with pytest.raises(tvmattn.TvmAttnError, match=r"Gather_0.*\[-32, 31\]"):
        imported.run({"buckets": buckets})


@pytest.mark.parametrize("op", ["Gather", "GatherElements"])
def test_a_gather_along_a_symbolic_axis_checks_its_indices(op):
    """The gathered axis has the graph's length n: indices are checked against it when the model runs."""
    index_shape = [2, "k"] if op == "GatherElements" else ["k"]
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node(op, ["x", "i"], ["y"], axis=1)], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, "n"]),
         onnx.helper.make_tensor_value_info("i", onnx.TensorProto.INT64, index_shape)],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, "k"])])
    imported = tvmattn.import_onnx(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]))
    x = np.arange(10, dtype=np.float32).reshape(2, 5)
    index = np.array([[0, 4, -1], [-5, 2, 1]]) if op == "GatherElements" else np.array([0, 4, -1, -5])
    expected = np.take_along_axis(x, index % 5, axis=1) if op == "GatherElements" else np.take(x, index, axis=1)
    assert np.array_equal(imported.run({"x": x, "i": index})[0], expected)
    for bad in (5, -6, 2**40):
        index.flat[1] = bad
        with pytest.raises(tvmattn.TvmAttnError, match=rf"{op}_0' \({op}\).*outside \[-n, n\)"):
            imported.run({"x": x, "i": index})


@pytest.mark.parametrize("index_shape", [(1, 3, 4), (3, 4), (2, 1, 4)])
def test_gather_elements_of_broadcast_indices_checks_them_before_the_broadcast(index_shape):
    """Indices expanded over a batch (DeBERTa's relative positions): checked as given, then read in place
    through the broadcast (no expanded index tensor is written)."""
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Expand", ["i", "shape"], ["wide"]),
         onnx.helper.make_node("GatherElements", ["x", "wide"], ["y"], axis=2)], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 4]),
         onnx.helper.make_tensor_value_info("i", onnx.TensorProto.INT64, list(index_shape))],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3, 4])],
        initializer=[onnx.helper.make_tensor("shape", onnx.TensorProto.INT64, [3], [2, 3, 4])])
    imported = tvmattn.import_onnx(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]))
    assert not any("broadcast_to" in name for name in imported.report.rule_of)
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    index = np.random.default_rng(1).integers(-4, 4, index_shape)
    expected = np.take_along_axis(x, np.broadcast_to(index % 4, (2, 3, 4)), axis=2)
    assert np.array_equal(imported.run({"x": x, "i": index})[0], expected)
    index[(0,) * (len(index_shape) - 1) + (3,)] = 4
    with pytest.raises(tvmattn.TvmAttnError, match=r"GatherElements.*\[-4, 3\]"):
        imported.run({"x": x, "i": index})


@pytest.mark.parametrize("feed, message", [
    (None, "mapping"), ({"ids": np.zeros((1, 0), np.int64)}, "empty dimension"),
    ({"ids": np.zeros((1, 2), np.int32)}, "int32; the model takes int64"),
    ({"ids": np.broadcast_to(np.int64(1), (1 << 20, 1 << 20))}, "GiB"),
])
def test_a_bad_feed_is_one_clean_error(feed, message):
    model = tvmattn.import_onnx(onnx_fuzz._embedding_model())
    with pytest.raises(tvmattn.TvmAttnError, match=message):
        model.run(feed)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_non_finite_query_shows_in_its_row_as_onnx_runtime_shows_it(value):
    model, feed = onnx_fuzz.base_models()["attention23_gqa_mask"]
    feed = {k: v.copy() for k, v in feed.items()}
    feed["q"][0, 1, 3, 2] = value
    got, want = tvmattn.import_onnx(model).run(feed)[0], ort_run(model, feed)[0]
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got[0, 1, 3]).all()
    finite = ~np.isnan(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-5)

"""PyTorch exports (TorchScript and dynamo exporters) imported by tvmattn and checked against ONNX Runtime.

nn.MultiheadAttention with no mask, a causal attn_mask and a key_padding_mask; F.scaled_dot_product_attention
(causal); hand-written attention with masked_fill; Swin v2's cosine attention (a scale a head); and Hugging
Face's eager attention as its GPT-2, Llama and GPT-OSS modules write it (causal mask from a tril buffer with
Where(finfo.min); repeat_kv for GQA; GPT-OSS's sink logits). Batch and sequence are dynamic; the report must
show the attention on a tvmattn kernel. (TorchScript bakes nn.MultiheadAttention's sequence length into its
reshapes, so that export varies only the batch.)
"""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from onnx_testing import assert_matches_ort, errors, kernels_used, ort_run  # noqa: E402

import tvmattn  # noqa: E402

E, HEADS = 32, 4


class MHA(torch.nn.Module):
    def __init__(self, mask: str) -> None:
        super().__init__()
        self.attn, self.mask = torch.nn.MultiheadAttention(E, HEADS, batch_first=True), mask

    def forward(self, x, pad=None):
        if self.mask == "causal":
            n = x.shape[1]
            causal = torch.triu(torch.full((n, n), float("-inf")), 1)
            return self.attn(x, x, x, attn_mask=causal, need_weights=False)[0]
        return self.attn(x, x, x, key_padding_mask=pad, need_weights=False)[0]


class FusedQKV(torch.nn.Module):
    """One Linear projecting x to q, k and v side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(E, 3 * E)


class SDPA(FusedQKV):
    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, E // HEADS).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, E)


class HandWritten(FusedQKV):
    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, HEADS, -1).transpose(1, 2) for t in self.qkv(x).split(E, dim=2))
        w = (q @ k.transpose(-2, -1)) / math.sqrt(E // HEADS)
        w = w.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return (w.softmax(-1) @ v).transpose(1, 2).reshape(b, n, E)


class CosineAttention(FusedQKV):
    """Swin v2's: normalized q and k, their product times a learned scale a head (the kernel's scale is one
    number: the importer multiplies q's heads instead)."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = torch.nn.Parameter(torch.log(10 * torch.rand(HEADS, 1, 1) + 1))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, HEADS, -1).transpose(1, 2) for t in self.qkv(x).split(E, dim=2))
        w = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        w = w * torch.clamp(self.logit_scale, max=math.log(100.0)).exp()
        return (w.softmax(-1) @ v).transpose(1, 2).reshape(b, n, E)


class GPT2Attention(torch.nn.Module):
    """transformers' GPT2Attention._attn (eager), with its Conv1D projections as Linear."""

    def __init__(self, max_positions: int = 64) -> None:
        super().__init__()
        self.c_attn, self.c_proj = torch.nn.Linear(E, 3 * E), torch.nn.Linear(E, E)
        self.register_buffer("bias", torch.tril(torch.ones(max_positions, max_positions, dtype=torch.bool))
                             .view(1, 1, max_positions, max_positions), persistent=False)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, HEADS, -1).permute(0, 2, 1, 3) for t in self.c_attn(x).split(E, dim=2))
        w = torch.matmul(q, k.transpose(-1, -2)) / torch.full([], v.size(-1) ** 0.5)
        query_length, key_length = q.size(-2), k.size(-2)
        causal = self.bias[:, :, key_length - query_length:key_length, :key_length]
        w = torch.where(causal, w, torch.full([], torch.finfo(w.dtype).min))
        o = torch.matmul(F.softmax(w, dim=-1), v)
        return self.c_proj(o.permute(0, 2, 1, 3).reshape(b, n, E))


class Gpt1Attention(GPT2Attention):
    """transformers' OpenAIGPT Attention._attn: its causal buffer of ones and zeros blended into the scores,
    w·b − 1e4·(1 − b), not selected (``ones``: that buffer; one not of zeros and ones is no mask)."""

    def __init__(self, ones: torch.Tensor | None = None) -> None:
        super().__init__()
        self.bias = self.bias.float() if ones is None else ones

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, HEADS, -1).permute(0, 2, 1, 3) for t in self.c_attn(x).split(E, dim=2))
        w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(v.size(-1))
        keep = self.bias[:, :, :n, :n]
        w = w * keep + -1e4 * (1 - keep)
        o = torch.matmul(F.softmax(w, dim=-1), v)
        return self.c_proj(o.permute(0, 2, 1, 3).reshape(b, n, E))


class LlamaAttention(torch.nn.Module):
    """transformers' eager_attention_forward with repeat_kv (GQA) and an additive causal mask."""

    def __init__(self, kv_heads: int = 2) -> None:
        super().__init__()
        self.kv_heads, self.d = kv_heads, E // HEADS
        self.q_proj = torch.nn.Linear(E, E, bias=False)
        self.k_proj = torch.nn.Linear(E, kv_heads * self.d, bias=False)
        self.v_proj = torch.nn.Linear(E, kv_heads * self.d, bias=False)
        self.o_proj = torch.nn.Linear(E, E, bias=False)

    def logits(self, x):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, HEADS, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.d).transpose(1, 2)
        group = HEADS // self.kv_heads
        k = k[:, :, None, :, :].expand(b, self.kv_heads, group, n, self.d).reshape(b, HEADS, n, self.d)
        v = v[:, :, None, :, :].expand(b, self.kv_heads, group, n, self.d).reshape(b, HEADS, n, self.d)
        mask = torch.full((n, n), torch.finfo(x.dtype).min).triu(1)[None, None]
        return torch.matmul(q, k.transpose(2, 3)) * self.d ** -0.5 + mask, v  # (b, h, n, n), (b, h, n, d)

    def forward(self, x):
        w, v = self.logits(x)
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(w.dtype)
        return self.o_proj(torch.matmul(w, v).transpose(1, 2).reshape(*x.shape))


class QueryNormAttention(LlamaAttention):
    """Hunyuan's: q and k RMS-normalised a head after their projection, each times a learned weight along
    d_k; on q the weight's multiply comes after the transposition to heads, next to the product."""

    def __init__(self) -> None:
        super().__init__()
        self.q_norm, self.k_norm = (torch.nn.Parameter(1 + torch.rand(self.d)) for _ in range(2))

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, HEADS, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.d).transpose(1, 2)
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * self.q_norm
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * self.k_norm
        group = HEADS // self.kv_heads
        k = k[:, :, None, :, :].expand(b, self.kv_heads, group, n, self.d).reshape(b, HEADS, n, self.d)
        v = v[:, :, None, :, :].expand(b, self.kv_heads, group, n, self.d).reshape(b, HEADS, n, self.d)
        w = F.softmax(torch.matmul(q, k.transpose(2, 3)) * self.d ** -0.5, dim=-1)
        return self.o_proj(torch.matmul(w, v).transpose(1, 2).reshape(*x.shape))


class GptOssAttention(LlamaAttention):
    """transformers' GPT-OSS eager attention: each head's sink logit joined as one more key, the row max
    subtracted, the sink's weight dropped after the softmax."""

    def __init__(self, kept: slice = slice(None, -1)) -> None:
        super().__init__()
        self.sinks, self.kept = torch.nn.Parameter(torch.randn(HEADS)), kept

    def forward(self, x):
        w, v = self.logits(x)
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(w.shape[0], -1, w.shape[2], -1)
        w = torch.cat([w, sinks], dim=-1)
        w = F.softmax(w - w.max(dim=-1, keepdim=True).values, dim=-1)[..., self.kept]
        return self.o_proj(torch.matmul(w, v).transpose(1, 2).reshape(*x.shape))


MODELS = {"mha": lambda: MHA("none"), "mha-causal": lambda: MHA("causal"), "mha-padding": lambda: MHA("padding"),
          "sdpa-causal": SDPA, "hand-written": HandWritten, "hf-gpt2": GPT2Attention, "hf-gpt1": Gpt1Attention,
          "hf-llama": LlamaAttention,
          "hf-gpt-oss": GptOssAttention, "swinv2-cosine": CosineAttention, "hunyuan-qk-norm": QueryNormAttention}


def export(name: str, dynamo: bool) -> onnx.ModelProto:
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    x = torch.randn(2, 5, E)
    args, names = ((x, torch.zeros(2, 5, dtype=torch.bool)), ["x", "pad"]) if name == "mha-padding" else ((x,), ["x"])
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            dims = {n: {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")} for n in names}
            torch.onnx.export(model, args, f, input_names=names, output_names=["y"], dynamo=True,
                              dynamic_shapes=dims, verbose=False)
        else:
            axes = {n: {0: "batch", 1: "seq"} for n in names}
            torch.onnx.export(model, args, f, input_names=names, output_names=["y"], dynamo=False,
                              dynamic_axes=axes)
    return onnx.load_from_string(f.getvalue())


def feeds(name: str, dynamo: bool) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    sizes = ((2, 5), (3, 9)) if dynamo or not name.startswith("mha") else ((2, 5), (3, 5))
    out = []
    for b, n in sizes:
        feed = {"x": rng.standard_normal((b, n, E)).astype(np.float32)}
        if name == "mha-padding":
            feed["pad"] = np.zeros((b, n), bool)
            feed["pad"][-1, n // 2:] = True
        out.append(feed)
    return out


# dynamo exports take seconds each: the default run covers nn.MultiheadAttention and HF Llama with it
DYNAMO_DEFAULT = {"mha-causal", "mha-padding", "hf-llama"}


def _cases():
    for name in MODELS:  # (the two MHA forms the default run exports with dynamo: their torchscript under -m slow)
        yield pytest.param(name, False, id=f"{name}-torchscript",
                           marks=[pytest.mark.slow] if name in DYNAMO_DEFAULT - {"hf-llama"} else [])
        yield pytest.param(name, True, id=f"{name}-dynamo",
                           marks=[] if name in DYNAMO_DEFAULT else [pytest.mark.slow])


@pytest.mark.parametrize("name,dynamo", list(_cases()))
def test_torch_export_matches_onnx_runtime(name, dynamo):
    imported = assert_matches_ort(export(name, dynamo), feeds(name, dynamo), attentions=1)
    spec = imported.report.replacements[0].spec
    if name in ("hf-llama", "hf-gpt-oss", "hunyuan-qk-norm"):
        assert spec.h_kv == 2
    assert spec.sinks == (name == "hf-gpt-oss")
    if name in ("mha-causal", "hf-gpt2", "hf-llama", "hf-gpt-oss", "sdpa-causal", "hand-written"):
        assert spec.causal or spec.attn_mask is not None
    if name == "hf-gpt1":  # the blended buffer read as the causal rule, at symbolic and at static sizes
        assert spec.causal and spec.attn_mask is None
        static = tvmattn.import_onnx(export(name, dynamo), shapes={"x": (2, 5, E)})
        assert static.report.replacements[0].spec.causal, str(static.report)
        feed = feeds(name, dynamo)[0]
        assert errors(static.run(feed)[0], ort_run(export(name, dynamo), feed)[0])[1] <= 1e-4


def test_a_blend_by_a_buffer_not_of_zeros_and_ones_is_left_to_tvm():
    """w·b − 1e4·(1 − b) is a mask only where b is 0 or 1: with a 0.5 in b it is arithmetic, run as written."""
    ones = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)
    ones[..., 3, 1] = 0.5
    torch.manual_seed(0)
    model, x = Gpt1Attention(ones).eval(), torch.randn(2, 5, E)
    f = io.BytesIO()
    torch.onnx.export(model, (x,), f, input_names=["x"], output_names=["y"], dynamo=False,
                      dynamic_axes={"x": {0: "batch", 1: "seq"}})
    proto = onnx.load_from_string(f.getvalue())
    imported = tvmattn.import_onnx(proto)
    assert kernels_used(imported) == 0, str(imported.report)
    feed = {"x": np.random.default_rng(0).standard_normal((2, 5, E)).astype(np.float32)}
    assert errors(imported.run(feed)[0], ort_run(proto, feed)[0])[1] <= 1e-4


def test_weights_sliced_otherwise_than_the_sink_off_are_left_to_tvm():
    """[..., 1:] keeps the sink's weight and drops key 0's: not attention with sinks."""
    torch.manual_seed(0)
    model, x = GptOssAttention(slice(1, None)).eval(), torch.randn(2, 5, E)
    f = io.BytesIO()
    torch.onnx.export(model, (x,), f, input_names=["x"], output_names=["y"], dynamo=False,
                      dynamic_axes={"x": {0: "batch", 1: "seq"}})
    proto = onnx.load_from_string(f.getvalue())
    imported = tvmattn.import_onnx(proto)
    fate, = imported.report.softmaxes
    assert fate.kernel is None and "keep other columns than the keys" in fate.reason, str(imported.report)
    feed = feeds("hf-llama", False)[1]
    np.testing.assert_allclose(imported.run(feed)[0], ort_run(proto, feed)[0], rtol=1e-5, atol=1e-5)


class BlockPad(torch.nn.Module):
    """LongT5's padding of its tokens to whole blocks, F.pad by an amount computed from the length (TorchScript
    writes it through Concat, Reshape, a reversing Slice and a Transpose); ``mode`` "reflect" is left to TVM."""

    def __init__(self, mode: str = "constant") -> None:
        super().__init__()
        self.mode = mode

    def forward(self, x):
        pad = (-x.shape[1]) % 5
        if self.mode == "constant":
            y = F.pad(x, (0, 0, 0, pad), value=-2.0)
        else:
            y = F.pad(x.transpose(1, 2), (0, pad), mode=self.mode).transpose(1, 2)
        return y.reshape(x.shape[0], -1, 5, x.shape[2]).sum(2)


@pytest.mark.parametrize("mode", ["constant", "reflect"])
def test_pad_by_an_amount_computed_from_the_length(mode):
    """At symbolic sizes the pads are read back as an expression of the length (TVM's converter took only
    numbers, "Dynamic pads are not supported"); against ONNX Runtime at lengths that need 0 to 4 more rows.
    A computed reflection is still refused, with the sentence that says to bind the sizes."""
    f = io.BytesIO()
    x = torch.randn(2, 7, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(BlockPad(mode), (x,), f, input_names=["x"], output_names=["y"], dynamo=False,
                          dynamic_axes={"x": {0: "batch", 1: "seq"}})
    proto = onnx.load_from_string(f.getvalue())
    if mode != "constant":
        with pytest.raises(tvmattn.TvmAttnError, match="pads are computed.*static shapes"):
            tvmattn.import_onnx(proto)
        return
    imported = tvmattn.import_onnx(proto)
    rng = np.random.default_rng(0)
    for n in (5, 6, 7, 9, 12):
        feed = {"x": rng.standard_normal((2, n, 8)).astype(np.float32)}
        got, want = imported.run(feed)[0], ort_run(proto, feed)[0]
        assert got.shape == want.shape and errors(got, want)[1] <= 1e-5, n

"""Hugging Face causal LMs exported to ONNX as a generation loop runs them: a prefill graph (the prompt
into an empty cache) and a "with past" decode graph (new tokens against ``past_key_{i}`` /
``past_value_{i}`` inputs, ``present_key_{i}`` / ``present_value_{i}`` outputs). Small models from a
config with seeded random weights (``transformers`` and ``torch`` needed; nothing is downloaded).

    model = decoder("gpt2")                              # eval(), 2 layers, d = 64
    onnx_model = export(model, "dynamo", past=True)      # or "torchscript"; past=False: the prefill

The exported graphs name the cache length ``past`` (decode) or the prompt length ``seq`` (prefill);
`tvmattn.import_onnx` keeps them symbolic.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import onnx

VOCAB = 96


def decoder(family: str = "gpt2", *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
            seed: int = 0) -> Any:
    """A small causal LM with random weights, eager attention (the decomposed MatMul/Softmax chain)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=heads,
                                      n_positions=256, initializer_range=0.2, bos_token_id=0, eos_token_id=0)
    elif family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                       num_hidden_layers=layers, num_attention_heads=heads,
                                       num_key_value_heads=kv_heads, max_position_embeddings=256)
    else:
        raise ValueError(f"unknown family {family!r}: gpt2 or llama")
    cfg._attn_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def cache_shape(model: Any, past: int, batch: int = 1) -> tuple[int, int, int, int]:
    """(B, h_kv, past, d) of one layer's cached keys or values."""
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads  # explicit in Qwen3, Gemma
    return batch, getattr(cfg, "num_key_value_heads", None) or heads, past, head_dim


def names(model: Any, past: bool, attention_mask: bool = False) -> tuple[list[str], list[str]]:
    """The exported graph's input and output names."""
    layers = range(model.config.num_hidden_layers)
    cache = [f"{kind}_{i}" for i in layers for kind in ("key", "value")]
    inputs = ["input_ids"] + (["attention_mask"] if attention_mask else []) + ([f"past_{c}" for c in cache]
                                                                              if past else [])
    return inputs, ["logits"] + [f"present_{c}" for c in cache]


def wrapper(model: Any, attention_mask: bool = False) -> Any:
    """A module taking (input_ids, [attention_mask,] past keys and values as plain tensors) and
    returning (logits, present keys and values): the interface of an exported decoder."""
    import torch
    from transformers import DynamicCache

    class WithPast(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, *past):
            mask, past = (past[0], past[1:]) if attention_mask else (None, past)
            cache = DynamicCache()
            for i in range(0, len(past), 2):
                cache.update(past[i], past[i + 1], i // 2)
            out = self.model(input_ids=input_ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            present = []
            for layer in out.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    return WithPast().eval()


def export(model: Any, exporter: str, *, past: bool, seq: int | None = None, past_len: int = 5, batch: int = 1,
           attention_mask: bool = False, max_len: int = 200) -> onnx.ModelProto:
    """The decoder as ``exporter`` ("dynamo" or "torchscript") writes it: with a cache input (``past``
    symbolic, ``seq`` new tokens) or the prefill (``seq`` symbolic, from an empty cache); with
    ``attention_mask`` (decode only) a (B, past + seq) 1/0 input, for batches with left padding.
    ``max_len``: the longest cache or prompt the dynamo export accepts."""
    import torch

    if attention_mask and not past:
        raise ValueError("attention_mask is exported with the decode graph only")
    inputs, outputs = names(model, past, attention_mask)
    seq = seq or (1 if past else 5)  # the traced sizes; the dynamo exporter's symbolic sizes start at 2
    ids = torch.randint(0, VOCAB, (batch, seq))
    cache = [torch.randn(cache_shape(model, past_len, batch)) for _ in inputs[1 + attention_mask:]]
    mask = [torch.ones(batch, past_len + seq, dtype=torch.int64)] if attention_mask else []
    module = wrapper(model, attention_mask)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            size = torch.export.Dim("past" if past else "seq", min=2, max=max_len)
            shapes = ({"input_ids": None, "past": tuple([{1: size + seq}] * len(mask) + [{2: size}] * len(cache))}
                      if past else {"input_ids": {1: size}})
            program = torch.onnx.export(module, (ids, *mask, *cache), dynamo=True, input_names=inputs,
                                        output_names=outputs, dynamic_shapes=shapes, verbose=False)
            return program.model_proto
        if exporter == "torchscript":
            buffer = io.BytesIO()
            axes = {n: {2: "past"} for n in inputs[1:]} if past else {"input_ids": {1: "seq"}}
            if attention_mask:
                axes["attention_mask"] = {1: "total"}
            torch.onnx.export(module, (ids, *mask, *cache), buffer, dynamo=False, input_names=inputs,
                              output_names=outputs, dynamic_axes=axes)
            return onnx.load_model_from_string(buffer.getvalue())
    raise ValueError(f"unknown exporter {exporter!r}: dynamo or torchscript")


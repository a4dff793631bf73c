"""Export a Hugging Face model (random weights from a config: nothing is downloaded) to ONNX with
torch's dynamo exporter, batch and sequence named ``batch`` and ``seq``, for `tvmattn bench model.onnx`.

    python scripts/export_hf.py gpt2 -o gpt2.onnx                 # GPT-2 small's width, 2 layers
    python scripts/export_hf.py bert --layers 4 -o bert.onnx      # BERT-base-like, with attention_mask
    python scripts/export_hf.py llama -o llama.onnx               # GQA 12/4 heads, rotary, SiLU MLP
    python scripts/export_hf.py gpt2 --decode -o gpt2-decode.onnx   # one token against a KV cache
    tvmattn bench gpt2.onnx --at batch=1 --at seq=128
    tvmattn bench gpt2-decode.onnx --at past=512                   # the cache length is named ``past``
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import onnx
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import hf_decoders  # noqa: E402

WIDTH, HEADS = 768, 12  # GPT-2 small / BERT-base


def build(family: str, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    eager = {"attn_implementation": "eager"}
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_embd=WIDTH, n_layer=layers, n_head=HEADS)
        return transformers.AutoModelForCausalLM.from_config(cfg, **eager).eval()
    if family == "llama":
        cfg = transformers.LlamaConfig(hidden_size=WIDTH, intermediate_size=2048, num_hidden_layers=layers,
                                       num_attention_heads=HEADS, num_key_value_heads=4, vocab_size=32000)
        return transformers.AutoModelForCausalLM.from_config(cfg, **eager).eval()
    if family == "bert":
        cfg = transformers.BertConfig(num_hidden_layers=layers)
        return transformers.AutoModel.from_config(cfg, **eager).eval()
    raise SystemExit(f"unknown family {family!r}: gpt2, bert or llama")


class _Outputs(torch.nn.Module):
    """One output (logits, or BERT's last hidden state), no cache."""

    def __init__(self, model: torch.nn.Module, bert: bool) -> None:
        super().__init__()
        self.model, self.bert = model, bert

    def forward(self, input_ids, attention_mask=None):
        if self.bert:
            return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.model(input_ids=input_ids, use_cache=False).logits


def export(family: str, layers: int, decode: bool = False) -> onnx.ModelProto:
    model = build(family, layers)
    if decode and family == "bert":
        raise SystemExit("bert is an encoder: it has no decode step (--decode is for gpt2 and llama)")
    if decode:
        return hf_decoders.export(model, "dynamo", past=True)
    bert = family == "bert"
    names = ["input_ids", "attention_mask"] if bert else ["input_ids"]
    args = tuple(torch.ones(2, 8, dtype=torch.long) for _ in names)
    batch, seq = torch.export.Dim("batch", max=64), torch.export.Dim("seq", max=4096)
    shapes = tuple({0: batch, 1: seq} for _ in names)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(_Outputs(model, bert), args, dynamo=True, input_names=names,
                                    output_names=["out"], dynamic_shapes=shapes, verbose=False)
    return program.model_proto


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family", choices=("gpt2", "bert", "llama"))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--decode", action="store_true", help="the one-token decode graph with a KV cache (``past``)")
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args()
    onnx.save(export(args.family, args.layers, args.decode), args.output)
    print(f"{args.family} ({args.layers} layers) → {args.output}")


if __name__ == "__main__":
    main()

"""Real model configurations as AttentionSpecs (one attention layer each)."""

from __future__ import annotations

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.spec import AttentionSpec

PRESETS: dict[str, AttentionSpec] = {
    # GPT-2 small: 12 heads of 64, causal self-attention over its 1024-token context.
    "gpt2-small": AttentionSpec(batch=1, seq_len=1024, d_model=768, num_heads=12, causal=True),
    # BERT base: bidirectional, 512 tokens, padded batches (each sequence's key count at run time).
    "bert-base": AttentionSpec(batch=2, seq_len=512, d_model=768, num_heads=12, key_padding=True),
    # A Llama-3.2-1B layer: 32 query heads sharing 8 key/value heads (GQA), causal.
    "llama-gqa": AttentionSpec(batch=1, seq_len=1024, d_model=2048, num_heads=32, num_kv_heads=8,
                               causal=True),
    # T5 base decoder cross-attention: 128 decoder positions attend to 512 encoder positions.
    "t5-cross": AttentionSpec(batch=2, seq_len=128, kv_seq_len=512, d_model=768, num_heads=12),
    # KV-cache decode: one new query against 4096 cached keys, Llama-2-7B heads (core kernel).
    "decode-4k": AttentionSpec(batch=1, seq_len=1, kv_seq_len=4096, num_heads=32, head_dim=128,
                               causal=True, causal_align="bottom_right", projections=False),
}


def preset(name: str) -> AttentionSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise TvmAttnError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}") from None

"""A Hugging Face `transformers` attention backend: ``attn_implementation="tvmattn"``.

transformers calls the backend as ``fn(module, query, key, value, attention_mask, dropout=…,
scaling=…, is_causal=…, **kwargs)`` with (B, h, n, d) tensors and wants ``((B, n, h, d), weights)``,
as its ``sdpa_attention_forward`` does. The masks are built as for "sdpa" (bool, True = attend, or
None where ``is_causal`` says it all), so prefill and the KV-cache decode step (one query whose
mask, or the lack of one, already aligns it bottom-right) reach the same kernels as the drop-in
function. A model's attention sinks (gpt-oss's ``s_aux``) go to the kernel as its ``sinks``.
"""

from __future__ import annotations

from typing import Any

import torch

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.torch.sdpa import scaled_dot_product_attention


def tvmattn_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, is_causal: bool | None = None,
                              position_bias: torch.Tensor | None = None, s_aux: torch.Tensor | None = None,
                              **kwargs: Any) -> tuple[torch.Tensor, None]:
    if kwargs.get("softcap") is not None:
        raise TvmAttnError("this model soft-caps its attention scores, which the tvmattn HF backend does not "
                           "pass on yet: use attn_implementation='eager'")
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is not None and attention_mask.shape[-1] > kv_len:  # a static cache's longer mask
        attention_mask = attention_mask[..., :kv_len]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # as transformers' sdpa backend: the mask is None exactly where top-left causal (or nothing, for one
    # query) is the whole mask
    is_causal = bool(q_len > 1 and attention_mask is None and is_causal)
    if is_causal and kv_len > q_len:  # prefill into an empty static cache: the keys past the queries are unused
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    if position_bias is not None:
        from transformers.integrations.sdpa_attention import create_position_bias_mask

        attention_mask = create_position_bias_mask(position_bias, attention_mask, is_causal, query, key)
        is_causal = False
    out = scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                       is_causal=is_causal, scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
                                       sinks=s_aux)
    return out.transpose(1, 2).contiguous(), None


def register_hf(name: str = "tvmattn") -> str:
    """Register tvmattn with transformers' attention and mask interfaces under ``name``, and return it.

    Then ``AutoModelForCausalLM.from_config(cfg, attn_implementation="tvmattn")``, or
    ``model.set_attn_implementation("tvmattn")``, runs every attention layer on tvmattn kernels.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as err:
        raise TvmAttnError(f"register_hf needs transformers with an AttentionInterface (>= 4.48): "
                           f"pip install -U transformers ({err})") from None
    AttentionInterface.register(name, tvmattn_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name

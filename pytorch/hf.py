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
from tvmattn.torch.flash import flash_attn_func
from tvmattn.torch.paged import flash_attn_varlen_func, flash_attn_with_kvcache
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


def tvmattn_varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                     value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                     scaling: float | None = None, is_causal: bool | None = None,
                                     cu_seq_lens_q: torch.Tensor | None = None,
                                     cu_seq_lens_k: torch.Tensor | None = None,
                                     max_length_q: int | None = None, max_length_k: int | None = None,
                                     sliding_window: int | None = None, softcap: float | None = None,
                                     s_aux: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' continuous batching calls a flash backend with the step's tokens packed, (1, h, T, d),
    each sequence's keys read from the paged cache, (1, h_kv, T_k, d), and ``cu_seq_lens_q``/``_k``: one
    `flash_attn_varlen_func` call (no mask; a step of one token per sequence is the decode kernel's;
    gpt-oss's sinks, ``s_aux``, as the kernel's sinks).
    Without them (``generate()``), `tvmattn_attention_forward`."""
    if cu_seq_lens_q is None:
        return tvmattn_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                         is_causal=is_causal, s_aux=s_aux, softcap=softcap, **kwargs)
    if query.shape[0] != 1:
        raise TvmAttnError(f"continuous batching packs a step's tokens into one row, not {query.shape[0]}")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = (sliding_window - 1, 0 if causal else sliding_window - 1) if sliding_window else (-1, -1)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, h, d)
    out = flash_attn_varlen_func(q, k.contiguous(), v.contiguous(), cu_seq_lens_q.to(torch.int32),
                                 cu_seq_lens_k.to(torch.int32), max_length_q, max_length_k, dropout_p=dropout,
                                 softmax_scale=scaling, causal=causal, window_size=window, softcap=softcap or 0.0,
                                 sinks=s_aux)
    return out[None], None


def register_hf(name: str = "tvmattn") -> str:
    """Register tvmattn with transformers' attention and mask interfaces under ``name``, and return it.

    Then ``AutoModelForCausalLM.from_config(cfg, attn_implementation="tvmattn")``, or
    ``model.set_attn_implementation("tvmattn")``, runs every attention layer on tvmattn kernels.
    ``name + "_flash"`` is registered too, for continuous batching (``generate_batch``,
    ``ContinuousBatchingManager``), which takes only backends named "flash…": its packed steps go to
    `tvmattn_varlen_attention_forward`.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as err:
        raise TvmAttnError(f"register_hf needs transformers with an AttentionInterface (>= 4.48): "
                           f"pip install -U transformers ({err})") from None
    AttentionInterface.register(name, tvmattn_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    AttentionInterface.register(f"{name}_flash", tvmattn_varlen_attention_forward)
    AttentionMaskInterface.register(f"{name}_flash", sdpa_mask)
    _load_by_name(f"{name}_flash")
    return name


def for_continuous_batching(model: Any, name: str = "tvmattn") -> Any:
    """``model`` set to ``name + "_flash"`` (`register_hf` first), its continuous-batching backend. A model
    that lists the flash implementations it accepts (``_compatible_flash_implementations``: gpt-oss)
    would be switched to its own first choice: this model's list gains ours."""
    register_hf(name)
    listed = getattr(model, "_compatible_flash_implementations", None)
    if listed is not None and f"{name}_flash" not in listed:
        model._compatible_flash_implementations = [*listed, f"{name}_flash"]  # this model only
    model.set_attn_implementation(f"{name}_flash")
    return model


def _load_by_name(name: str) -> None:
    """transformers loads a "flash…" backend's functions by its name (`lazy_import_flash_attention`: the
    flash_attn package, else a kernels-hub repository) when a model is set to it; for ``name`` they are
    tvmattn's. A hook on its private loader: a transformers without one loads nothing by name."""
    try:
        import transformers.modeling_flash_attention_utils as fa
        loader, pad, unpad = fa._lazy_imports, fa._pad_input, fa._unpad_input
    except (ImportError, AttributeError):
        return
    names = getattr(loader, "tvmattn_names", None)
    if names is None:
        def lazy_imports(implementation, *args, **kwargs):
            if implementation in names:
                return flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, pad, unpad
            return loader(implementation, *args, **kwargs)

        names = lazy_imports.tvmattn_names = set()
        fa._lazy_imports = lazy_imports
    names.add(name)

"""tvmattn from PyTorch (needs torch; the rest of tvmattn never imports it).

    from tvmattn.torch import scaled_dot_product_attention   # F.scaled_dot_product_attention's signature
    from tvmattn.torch import flash_attn_func                # FlashAttention's: windows, softcap, ALiBi
    from tvmattn.torch import flash_attn_with_kvcache        # its decode step on a (paged) KV cache
    from tvmattn.torch import flash_attn_varlen_func         # its ragged batches (cu_seqlens), no padding
    torch.ops.tvmattn.attention                              # the same, as a custom op (torch.compile, export)
    tvmattn.torch.register_hf()                              # attn_implementation="tvmattn" in transformers
    tvmattn.torch.for_continuous_batching(model)             # "tvmattn_flash": generate_batch's paged steps
"""

from tvmattn.torch.cache import KERNELS
from tvmattn.torch.flash import flash_attn_func
from tvmattn.torch.hf import for_continuous_batching, register_hf
from tvmattn.torch.paged import flash_attn_varlen_func, flash_attn_with_kvcache
from tvmattn.torch.sdpa import scaled_dot_product_attention

__all__ = ["KERNELS", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
           "for_continuous_batching", "register_hf", "scaled_dot_product_attention"]

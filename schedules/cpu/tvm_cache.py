"""tvmattn's paged kernels with the signatures of TVM's own paged KV cache's CPU kernels (what MLC-LLM's
``TIRPagedKVCache`` hands to ``vm.builtin.paged_attention_kv_cache_create``, from
``tvm.relax.frontend.nn.llm``): the same bodies as `paged_decode`'s, reading TVM's arguments through
their hooks.

    pages        (max_pages, 2, h_kv, P, d): each page's K rows, then its V rows (two HND caches,
                 read through strided views)
    page table   CSR: page_indptr (B + 1,), page_values; a sequence's keys (pages − 1)·P + last_page_len
    q, output    (B, h, d) decode, (total, h, d) with q_indptr (B + 1,) prefill
    lse          (…, h) float32: each row's base-2 log-sum-exp of its logits, by which the cache merges
                 the attention over a shared prefix's pages with the rest
    sm_scale     at run time: the plans' specs have scale 1, the queries are scaled as they load
    causal       at run time (prefill): one body each way, chosen per call
RoPE inside the kernel (``rotary_mode`` 1, the cache's RopeMode.INLINE) is refused when called: the cache
applies it before appending otherwise.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tvmattn.schedules.cpu.paged_decode import PagedPlan, bodies

INLINE_ROPE = "tvmattn's kernels in TVM's paged cache take RoPE applied before the cache (RopeMode NONE or NORMAL)"


def _views(plan: PagedPlan):
    spec = plan.spec
    stride = (2 * spec.h_kv * spec.page_size * spec.head_dim, spec.page_size * spec.head_dim, spec.head_dim, 1)
    return stride, spec.h_kv * spec.page_size * spec.head_dim  # the V rows' offset in a page


def _csr_table(INDPTR, VALUES, LAST, nnz_pages, P: int):
    """TVM's CSR page table as the bodies' hooks: a sequence's j-th page (its index clamped into the
    values) and its keys, (pages − 1)·P + last_page_len (clamped into its pages)."""
    return (lambda b, j: VALUES[T.max(T.min(INDPTR[b] + j, nnz_pages - 1), 0)],
            lambda b: T.max(T.min((INDPTR[b + 1] - INDPTR[b] - 1) * P + LAST[b], (INDPTR[b + 1] - INDPTR[b]) * P), 0))


def _by_mask(causal: PagedPlan, full: PagedPlan):
    """The prefill body of the ``causal`` plan or of the ``full`` one, as the run-time flag says; lse kept."""
    masked, unmasked = bodies(causal), bodies(full)

    @T.macro
    def prefill(is_causal, query_at, K, V, page_at, length_of, CU, O, LSE, batch, pages, total):
        if is_causal == 1:
            masked(query_at, K, V, page_at, length_of, CU, LSE, LSE, O, LSE, True, batch, pages, total)
        else:
            unmasked(query_at, K, V, page_at, length_of, CU, LSE, LSE, O, LSE, True, batch, pages, total)

    return prefill


def decode_kernel(plan: PagedPlan) -> tirx.PrimFunc:
    """``_attention_decode_cpu``'s signature: q (B, h, d), one new query per sequence."""
    spec = plan.spec
    H, HKV, D, P, dt = spec.h, spec.h_kv, spec.head_dim, spec.page_size, spec.dtype
    decode_body = bodies(plan)
    stride, v_rows = _views(plan)

    @T.prim_func
    def batch_decode_paged_kv(Q_handle: T.handle, pages_handle: T.handle, page_table_indptr_handle: T.handle,
                              page_table_values_handle: T.handle, var_length_info: T.handle,
                              k_rope_pos_offset_handle: T.handle, q_rope_position_handle: T.handle,
                              output_handle: T.handle, lse_handle: T.handle, rotary_mode: T.int32,
                              rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"global_symbol": "batch_decode_paged_kv_cpu", "tirx.noalias": True, "tirx.is_scheduled": True})
        B, nnz_pages, max_num_pages = T.int32(), T.int32(), T.int32()
        indptr_offset, values_offset, length_offset = T.int32(), T.int32(), T.int32()
        k_rope_offset, q_rope_offset = T.int32(), T.int32()
        Q = T.match_buffer(Q_handle, (B, H, D), dt)
        PAGES = T.match_buffer(pages_handle, (max_num_pages, 2, HKV, P, D), dt)
        INDPTR = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32", elem_offset=indptr_offset)
        VALUES = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32", elem_offset=values_offset)
        LAST = T.match_buffer(var_length_info, (B,), "int32", elem_offset=length_offset)
        T.match_buffer(k_rope_pos_offset_handle, (B,), "int32", elem_offset=k_rope_offset)
        T.match_buffer(q_rope_position_handle, (B,), "int32", elem_offset=q_rope_offset)
        OUT = T.match_buffer(output_handle, (B, H, D), dt)
        LSE = T.match_buffer(lse_handle, (B, H), "float32")
        assert rotary_mode != 1, INLINE_ROPE
        K = T.decl_buffer((max_num_pages, HKV, P, D), dt, data=PAGES.data, strides=stride)
        V = T.decl_buffer((max_num_pages, HKV, P, D), dt, data=PAGES.data, elem_offset=v_rows, strides=stride)
        O = T.decl_buffer((B, 1, H, D), dt, data=OUT.data)
        page_at, length_of = T.meta_var(_csr_table(INDPTR, VALUES, LAST, nnz_pages, P))
        decode_body(lambda b, s, head, e: T.Cast("float32", Q[b, head, e]) * sm_scale, K, V, page_at, length_of,
                    LSE, LSE, O, LSE, True, B, max_num_pages)

    return batch_decode_paged_kv


def prefill_kernel(causal: PagedPlan, full: PagedPlan) -> tirx.PrimFunc:
    """``_attention_prefill_cpu``'s signature: each sequence's new queries (q_indptr) over its pages,
    ``causal`` (bottom-right) or not at run time: the ``causal`` plan's body or the ``full`` one's."""
    spec = causal.spec
    H, HKV, D, P, dt = spec.h, spec.h_kv, spec.head_dim, spec.page_size, spec.dtype
    prefill = _by_mask(causal, full)
    stride, v_rows = _views(causal)

    @T.prim_func
    def batch_prefill_paged_kv_cpu(var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle,
                                   var_page_indptr: T.handle, var_page_values: T.handle, var_length_info: T.handle,
                                   var_k_rope_pos_offset: T.handle, var_q_rope_position: T.handle,
                                   var_output: T.handle, var_lse: T.handle, causal: T.int32, rotary_mode: T.int32,
                                   rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"global_symbol": "batch_prefill_paged_kv_cpu", "tirx.noalias": True, "tirx.is_scheduled": True})
        B, total, nnz_pages, max_num_pages = T.int32(), T.int32(), T.int32(), T.int32()
        q_indptr_offset, indptr_offset, values_offset = T.int32(), T.int32(), T.int32()
        k_rope_offset, q_rope_offset, length_offset = T.int32(), T.int32(), T.int32()
        Q = T.match_buffer(var_q, (total, H, D), dt)
        CU = T.match_buffer(var_q_indptr, (B + 1,), "int32", elem_offset=q_indptr_offset)
        PAGES = T.match_buffer(var_pages, (max_num_pages, 2, HKV, P, D), dt)
        INDPTR = T.match_buffer(var_page_indptr, (B + 1,), "int32", elem_offset=indptr_offset)
        VALUES = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=values_offset)
        LAST = T.match_buffer(var_length_info, (B,), "int32", elem_offset=length_offset)
        T.match_buffer(var_k_rope_pos_offset, (B,), "int32", elem_offset=k_rope_offset)
        T.match_buffer(var_q_rope_position, (total,), "int32", elem_offset=q_rope_offset)
        O = T.match_buffer(var_output, (total, H, D), dt)
        LSE = T.match_buffer(var_lse, (total, H), "float32")
        assert rotary_mode != 1, INLINE_ROPE
        K = T.decl_buffer((max_num_pages, HKV, P, D), dt, data=PAGES.data, strides=stride)
        V = T.decl_buffer((max_num_pages, HKV, P, D), dt, data=PAGES.data, elem_offset=v_rows, strides=stride)
        page_at, length_of = T.meta_var(_csr_table(INDPTR, VALUES, LAST, nnz_pages, P))
        prefill(causal, lambda t, head, e: T.Cast("float32", Q[t, head, e]) * sm_scale, K, V, page_at, length_of,
                CU, O, LSE, B, max_num_pages, total)

    return batch_prefill_paged_kv_cpu


def ragged_kernel(causal: PagedPlan, full: PagedPlan) -> tirx.PrimFunc:
    """``_attention_prefill_ragged_cpu``'s signature: each sequence's new queries over its new keys,
    both packed (q_indptr, kv_indptr), the keys read as one-key NHD pages (the plans' page size is 1)."""
    spec = causal.spec
    H, HKV, D, dt = spec.h, spec.h_kv, spec.head_dim, spec.dtype
    prefill = _by_mask(causal, full)

    @T.prim_func
    def batch_prefill_ragged_kv(var_q: T.handle, var_q_indptr: T.handle, var_k: T.handle, var_v: T.handle,
                                var_kv_indptr: T.handle, var_q_rope_position: T.handle,
                                var_k_rope_pos_offset: T.handle, var_output: T.handle, var_lse: T.handle,
                                causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32,
                                sm_scale: T.float32):
        T.func_attr({"global_symbol": "batch_prefill_ragged_kv", "tirx.noalias": True, "tirx.is_scheduled": True})
        B, qo_len, kv_len = T.int32(), T.int32(), T.int32()
        q_indptr_offset, kv_indptr_offset, q_rope_offset, k_rope_offset = T.int32(), T.int32(), T.int32(), T.int32()
        Q = T.match_buffer(var_q, (qo_len, H, D), dt)
        CU = T.match_buffer(var_q_indptr, (B + 1,), "int32", elem_offset=q_indptr_offset)
        KK = T.match_buffer(var_k, (kv_len, HKV, D), dt)
        VV = T.match_buffer(var_v, (kv_len, HKV, D), dt)
        KV_CU = T.match_buffer(var_kv_indptr, (B + 1,), "int32", elem_offset=kv_indptr_offset)
        T.match_buffer(var_q_rope_position, (qo_len,), "int32", elem_offset=q_rope_offset)
        T.match_buffer(var_k_rope_pos_offset, (B,), "int32", elem_offset=k_rope_offset)
        O = T.match_buffer(var_output, (qo_len, H, D), dt)
        LSE = T.match_buffer(var_lse, (qo_len, H), "float32")
        assert rotary_mode != 1, INLINE_ROPE
        K = T.decl_buffer((kv_len, 1, HKV, D), dt, data=KK.data)
        V = T.decl_buffer((kv_len, 1, HKV, D), dt, data=VV.data)
        prefill(causal, lambda t, head, e: T.Cast("float32", Q[t, head, e]) * sm_scale, K, V,
                lambda b, j: T.max(T.min(KV_CU[b] + j, kv_len - 1), 0), lambda b: T.max(KV_CU[b + 1] - KV_CU[b], 0),
                CU, O, LSE, B, kv_len, qo_len)

    return batch_prefill_ragged_kv

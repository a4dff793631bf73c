"""The Hugging Face backend: tiny random-config Llama (GQA) and GPT-2 with attn_implementation="tvmattn"
give the logits of attn_implementation="sdpa" and the same greedy tokens through generate()'s KV cache."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import every_other_slow  # noqa: E402

import tvmattn.torch  # noqa: E402
from tvmattn.compiler.verify import TOLERANCE  # noqa: E402
from tvmattn.torch import KERNELS  # noqa: E402

VOCAB = 128
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=128),
    # a wider init than GPT-2's 0.02, so that greedy decoding is not a run of near-ties
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                            initializer_range=0.2, bos_token_id=0, eos_token_id=0),
}


@pytest.fixture(scope="module", autouse=True)
def registered():
    tvmattn.torch.register_hf()


def models(name: str, dtype=torch.float32):
    """The same random weights twice: on "sdpa" and on "tvmattn" (each with its own config copy: from_config
    writes the implementation into the config it is given)."""
    torch.manual_seed(0)
    cfg = CONFIGS[name]()
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa",
                                                        dtype=dtype).eval()
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="tvmattn",
                                                         dtype=dtype).eval()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def batch():
    """Two prompts, the second left-padded by four tokens."""
    ids = torch.randint(1, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask


def assert_close(out, ref, dtype: str) -> None:
    err = (out.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
    assert err <= TOLERANCE[dtype], f"max rel error {err:.3g} > {TOLERANCE[dtype]}"


@pytest.mark.parametrize("name,dtype", every_other_slow(list(CONFIGS), ["float32", "bfloat16"]))
def test_logits_match_sdpa(name, dtype):
    ref, ours = models(name, getattr(torch, dtype))
    ids, mask = batch()
    KERNELS.clear()
    with torch.no_grad():
        assert_close(ours(ids).logits, ref(ids).logits, dtype)
        valid = mask.bool()  # padded positions' logits are garbage in both
        assert_close(ours(ids, attention_mask=mask).logits[valid], ref(ids, attention_mask=mask).logits[valid], dtype)
    assert {(k.causal, k.mask) for k in KERNELS.keys()} == {(True, None), (False, "bool")}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_is_identical(name):
    ref, ours = models(name)
    ids, mask = batch()
    KERNELS.clear()
    settings = dict(max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
    want = ref.generate(ids[:1], **settings)
    assert len(set(want[0, 13:].tolist())) > 2  # a real sequence, not one token repeated
    assert torch.equal(ours.generate(ids[:1], **settings), want)
    # the decode steps (one query, the whole cache visible) ran on a kernel without mask or causal
    assert any(not k.causal and k.mask is None for k in KERNELS.keys())
    assert torch.equal(ours.generate(ids, attention_mask=mask, **settings),
                       ref.generate(ids, attention_mask=mask, **settings))


def switched(ref):
    """A copy of the built model ``ref`` switched to "tvmattn" (set_attn_implementation), its logits on the
    batch checked against ref's; and the batch's ids."""
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation("tvmattn")
    ids, _ = batch()
    KERNELS.clear()
    with torch.no_grad():
        assert_close(ours(ids).logits, ref(ids).logits, "float32")
    return ours, ids


def test_set_attn_implementation_on_a_built_model():
    switched(models("llama")[0])
    assert KERNELS.keys()


def gpt_oss():
    """A random gpt-oss on "eager" (it has no "sdpa"): a sliding-window layer, a full one, sinks far from 0."""
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=4,
                                    layer_types=["sliding_attention", "full_attention"])
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "sinks"):
                module.sinks.normal_(1.0, 1.0)
    return model


def test_gpt_oss_sinks_and_sliding_window():
    """gpt-oss (its attention sinks reach the backend as ``s_aux``; a sliding-window layer, a full one): the
    logits and greedy tokens of "eager", its own attention with sinks (gpt-oss has no "sdpa")."""
    ref = gpt_oss()
    ours, ids = switched(ref)
    with torch.no_grad():
        settings = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
        assert torch.equal(ours.generate(ids[:1], **settings), ref.generate(ids[:1], **settings))
    assert KERNELS.keys() and all(k.sinks for k in KERNELS.keys())


def test_continuous_batching_gives_the_default_paths_tokens(monkeypatch):
    """transformers' continuous batching (generate_batch: a paged cache, requests of mixed lengths packed
    into each step) on "tvmattn_flash": the greedy tokens of its "sdpa" path, every step's attention one
    tvmattn varlen call."""
    from tvmattn.torch import hf

    calls = []
    monkeypatch.setattr(hf, "flash_attn_varlen_func", lambda *a, **k: calls.append(a[3].shape[0] - 1) or
                        tvmattn.torch.flash_attn_varlen_func(*a, **k))
    ref, _ = models("llama")
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation("tvmattn_flash")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (int(n),), generator=g).tolist() for n in (1, 37, 5, 60, 2, 17)]
    config = transformers.GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with torch.no_grad():
        small = transformers.ContinuousBatchingConfig(num_blocks=8)  # (a cache sized from free memory is slow)
        want, got = (m.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=small,
                                      progress_bar=False) for m in (ref, ours))
    assert sorted(got) == sorted(want)
    assert [got[r].generated_tokens for r in sorted(got)] == [want[r].generated_tokens for r in sorted(want)]
    assert calls and max(calls) > 1  # packed steps of several sequences went through the varlen kernel


def test_continuous_batching_with_sinks_and_sliding_window():
    """gpt-oss (sinks as s_aux, a sliding-window layer and a full one) batched continuously on
    "tvmattn_flash": each request's greedy tokens as "eager" generate() gives them one at a time."""
    ref = gpt_oss()
    ours = tvmattn.torch.for_continuous_batching(copy.deepcopy(ref))  # (gpt-oss lists its flash backends)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (int(n),), generator=g).tolist() for n in (3, 11, 1, 7)]
    config = transformers.GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with torch.no_grad():
        got = ours.generate_batch(inputs=prompts, generation_config=config, progress_bar=False,
                                  continuous_batching_config=transformers.ContinuousBatchingConfig(num_blocks=8))
        want = [ref.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist() for p in prompts]
    assert [got[r].generated_tokens for r in sorted(got, key=lambda r: int(r.split("_")[-1]))] == want

"""Greedy generation from randomly initialised small Llama (GQA) and GPT-2 models, with
attn_implementation="sdpa" and "tvmattn": the tokens (identical, or the script exits 1), the prefill
time and the time per generated token, measured in one process (medians, interleaved).

    python scripts/hf_generate.py                       # Llama-style: 4 layers, hidden 1024, GQA 16/4; n=1024
    python scripts/hf_generate.py --quick               # tiny models, a short prompt: a smoke run

Prefill: the prompt's forward pass (last position's logits only, as generate() does); a token: one
decode step on the KV cache (about n long). Greedy decoding, written out so that each step is timed.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch  # noqa: E402
import transformers  # noqa: E402

import tvmattn.torch  # noqa: E402
from tvmattn.compiler import bench  # noqa: F401  TVM's pool: no spin (torch's OpenMP keeps its default)
from tvmattn.compiler.target import cpu_cores  # noqa: E402


def configs(quick: bool, vocab: int) -> dict[str, transformers.PretrainedConfig]:
    hidden, layers = (128, 2) if quick else (1024, 4)
    heads = hidden // 64
    return {
        "llama": transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                          num_hidden_layers=layers, num_attention_heads=heads,
                                          num_key_value_heads=max(1, heads // 4), max_position_embeddings=4096),
        "gpt2": transformers.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                                        n_positions=4096, initializer_range=0.2, bos_token_id=0, eos_token_id=0),
    }


def prefill(model, ids: torch.Tensor):
    """The prompt's forward pass into a fresh KV cache (last position's logits only, as generate does)."""
    out = model(ids, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].argmax(-1, keepdim=True), out.cache


def generate(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, list[float], list[int]]:
    """Greedy decoding with the KV cache: prefill seconds, seconds of each decode step, the tokens."""
    start = time.perf_counter()
    token, cache = prefill(model, ids)
    prefill_s, steps, tokens = time.perf_counter() - start, [], [token.item()]
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        out = model(token, cache=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        steps.append(time.perf_counter() - start)
        tokens.append(token.item())
    return prefill_s, steps, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models and a 32-token prompt")
    parser.add_argument("--prompt", type=int, help="prompt length n (default 1024, 32 with --quick)")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["llama", "gpt2"], choices=["llama", "gpt2"])
    args = parser.parse_args()
    n = args.prompt or (32 if args.quick else 1024)
    torch.set_num_threads(cpu_cores())
    tvmattn.torch.register_hf()
    print(f"threads {torch.get_num_threads()}, prompt n={n}, {args.new_tokens} new tokens, vocab {args.vocab}")
    same = True
    for name, cfg in configs(args.quick, args.vocab).items():
        if name not in args.models:
            continue
        torch.manual_seed(0)
        models = {impl: transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl)
                  .eval() for impl in ("sdpa", "tvmattn")}
        models["tvmattn"].load_state_dict(models["sdpa"].state_dict())
        ids = torch.randint(1, args.vocab, (1, n), generator=torch.Generator().manual_seed(0))
        runs = {impl: [] for impl in models}
        with torch.inference_mode():
            for model in models.values():
                generate(model, ids, 2)  # warm-up (tvmattn compiles its kernels here)
            for _ in range(args.repeats):
                for impl, model in models.items():  # interleaved, so that both see the same machine
                    runs[impl].append(generate(model, ids, args.new_tokens))
        print(f"\n{name}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, heads "
              f"{cfg.num_attention_heads}/{getattr(cfg, 'num_key_value_heads', cfg.num_attention_heads)}")
        med = {}
        for impl, rs in runs.items():
            med[impl] = (statistics.median(r[0] for r in rs), statistics.median(t for r in rs for t in r[1]))
            print(f"  {impl:<8} prefill {med[impl][0] * 1e3:8.1f} ms   per token {med[impl][1] * 1e3:7.2f} ms   "
                  f"tokens {rs[0][2]}")
        print(f"  sdpa/tvmattn: prefill {med['sdpa'][0] / med['tvmattn'][0]:.2f}×, "
              f"per token {med['sdpa'][1] / med['tvmattn'][1]:.2f}×")
        if runs["sdpa"][0][2] != runs["tvmattn"][0][2]:
            print("  TOKENS DIFFER")
            same = False
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

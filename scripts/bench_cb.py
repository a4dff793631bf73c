"""Hugging Face continuous batching (``generate_batch``: a paged KV cache, requests of mixed lengths
scheduled together) on tvmattn's kernels against its default CPU path, one process, interleaved rounds.

    default   attn_implementation="sdpa": each step's packed tokens attend through one SDPA call under a
              mask of every query against every key of the step (transformers' CPU path without flash)
    tvmattn   attn_implementation="tvmattn_flash" (`tvmattn.torch.register_hf`): one
              `flash_attn_varlen_func` call a layer, each sequence on its own keys, no mask

A random small Llama built from a config (no hub), greedy decoding; the generated tokens must be
identical, then tokens/s of each is timed in alternating rounds.

    python scripts/bench_cb.py [--requests 200] [--new-tokens 32] [--rounds 3] [--layers 4] [--hidden 256]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import transformers
from transformers import ContinuousBatchingConfig, GenerationConfig

import tvmattn.torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, nargs=2, default=[16, 512], help="prompt lengths, uniform in [a, b]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=256, help="the paged cache's blocks (of 256 tokens)")
    opts = parser.parse_args()
    tvmattn.torch.register_hf()
    heads = opts.hidden // 32
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=opts.hidden, intermediate_size=2 * opts.hidden,
                                   num_hidden_layers=opts.layers, num_attention_heads=heads,
                                   num_key_value_heads=max(heads // 4, 1), max_position_embeddings=4096)
    torch.manual_seed(0)
    models = {"default (sdpa)": transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                                              attn_implementation="sdpa").eval()}
    models["tvmattn"] = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(cfg), attn_implementation="tvmattn_flash").eval()
    models["tvmattn"].load_state_dict(models["default (sdpa)"].state_dict())
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(opts.prompt[0], opts.prompt[1] + 1, (opts.requests,), generator=g).tolist()
    prompts = [torch.randint(1, 1024, (n,), generator=g).tolist() for n in lengths]
    config = GenerationConfig(max_new_tokens=opts.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # a cache sized for the run (by default transformers sizes it from the free memory, and every
    # generate_batch then spends seconds of page faults on it, the same for both)
    batching = ContinuousBatchingConfig(num_blocks=opts.blocks)

    def run(model) -> list[list[int]]:
        with torch.no_grad():
            out = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=batching,
                                       progress_bar=False)
        return [out[k].generated_tokens for k in sorted(out, key=lambda r: int(r.split("_")[-1]))]

    tokens = {name: run(model) for name, model in models.items()}  # (also the warm-up)
    same = sum(a == b for a, b in zip(*tokens.values()))
    print(f"{opts.requests} requests, prompts {opts.prompt[0]}-{opts.prompt[1]} tokens (mean "
          f"{statistics.mean(lengths):.0f}), {opts.new_tokens} new each; Llama {opts.layers} layers, d={opts.hidden}, "
          f"{heads}/{max(heads // 4, 1)} heads; {torch.get_num_threads()} torch threads")
    print(f"  greedy tokens identical in {same} of {opts.requests} requests")
    seconds = {name: [] for name in models}
    for _ in range(opts.rounds):
        for name, model in models.items():
            start = time.perf_counter()
            run(model)
            seconds[name].append(time.perf_counter() - start)
    generated = opts.requests * opts.new_tokens
    rate = {name: generated / statistics.median(s) for name, s in seconds.items()}
    for name, r in rate.items():
        print(f"  {name:16s} {statistics.median(seconds[name]):7.2f} s  {r:8.1f} new tokens/s")
    print(f"  tvmattn / default: {rate['tvmattn'] / rate['default (sdpa)']:.2f}x")


if __name__ == "__main__":
    main()

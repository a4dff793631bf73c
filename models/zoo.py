"""The model zoo: transformer exports as users bring them, for a benchmark that cannot be tuned to.

Each entry is a Hugging Face family built from a small config with seeded random weights (nothing is
downloaded), 2 layers, a 4096-token vocabulary (real ones, 30k–250k, would make the LM head most of a
2-layer model's time), at a width of a real member of the family (128–1024), exported by one of
torch's TorchScript and dynamo exporters or by ONNX Runtime's transformer optimizer over one of those
(`models/zoo_export.py`). Batch and sequence stay symbolic where the exporter supports it.

    from tvmattn.models import zoo
    m = zoo.get("llama")                      # or zoo.select("encoder,gpt2")
    proto = m.export()                        # cached: ~/.cache/tvmattn/zoo/llama-<VERSION>-<torch…>.onnx
    feed = m.feed(m.shapes[0])                # NumPy inputs at (batch 2, 128 tokens)

A shape is (batch, n): n counts tokens (encoders, prefill, encoder-decoders: both sides), the cached
keys of a one-token decode step, an image's side, or audio frames (or samples). ``shapes[0]`` is the
smallest. ``TVMATTN_ZOO_CACHE`` moves the cache.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx

from tvmattn.models import zoo_export as ex
from tvmattn.models.zoo_export import LAYERS, MAX_POSITIONS, VOCAB

VERSION = "1"  # bump when a recipe changes: cached exports are keyed by it and the exporters' versions
CACHE = Path(os.environ.get("TVMATTN_ZOO_CACHE", Path.home() / ".cache" / "tvmattn" / "zoo"))

ENCODER, PREFILL, DECODE, SEQ2SEQ, VISION, AUDIO = (
    "encoder", "decoder prefill", "decode step", "encoder-decoder", "vision", "audio")
KINDS = (ENCODER, PREFILL, DECODE, SEQ2SEQ, VISION, AUDIO)
TOKENS = ((2, 128), (1, 512))
SHAPES = {ENCODER: TOKENS, PREFILL: TOKENS, SEQ2SEQ: TOKENS, DECODE: ((1, 128), (1, 512)), VISION: ((2, 224),)}
AXES = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
        "decoder_input_ids": {0: "batch", 1: "dseq"}, "pixel_values": {0: "batch"},
        "input_features": {0: "batch"}, "input_values": {0: "batch", 1: "seq"}}
TRACE_TOKENS = 8  # the exporters trace at batch 2 × 8 tokens (symbolic sizes start at 2 for dynamo)


@dataclass(frozen=True)
class Recipe:
    """How to build one family's model and call it."""

    auto: str  # transformers' class: AutoModel, AutoModelForCausalLM, …
    config: str  # its config class
    make_config: Callable[[int, int], dict[str, Any]]  # (width, heads) → the config's arguments
    inputs: tuple[str, ...] = ("input_ids",)
    output: str = "logits"  # the model output's attribute the export returns
    call: dict[str, Any] = field(default_factory=dict)  # extra forward arguments
    part: str | None = None  # a method giving the submodule to export (Whisper's encoder)
    example: tuple[int, ...] | None = None  # the traced input's shape where it is not tokens


@dataclass(frozen=True)
class ZooModel:
    name: str
    family: str
    exporter: str  # torchscript, dynamo, or ort-<source>: ONNX Runtime's optimizer over that export
    kind: str
    width: int
    heads: int
    recipe: Recipe
    note: str = ""  # why this exporter, where another failed
    ort_type: str = ""  # the optimizer's model_type (ort-* exporters)
    own_shapes: tuple[tuple[int, int], ...] = ()

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        return self.own_shapes or SHAPES[self.kind]

    @property
    def path(self) -> Path:
        return CACHE / f"{self.name}-{VERSION}-{_exporters()}.onnx"

    def export(self) -> onnx.ModelProto:
        """The exported model, from the disk cache when this version was exported before."""
        return _cached(self.name)

    def build(self) -> Any:
        """The torch model itself (random weights, seeded: the same every call)."""
        r = self.recipe
        return ex.hf(r.auto, r.config, r.make_config, self.width, self.heads, r.part)

    def feed(self, shape: tuple[int, int]) -> dict[str, np.ndarray]:
        """Seeded inputs at ``shape``: token ids in the vocabulary, an attention_mask that pads the
        first sequence by a quarter (at its end for encoders, at its start for decoders) where the
        batch has more than one, floats ~ N(0, 1) (images, audio, a decode step's cache)."""
        batch, n = shape
        rng = np.random.default_rng(batch * 10_000 + n)
        out = {}
        for name, dims, dtype in graph_inputs(self):
            sizes = tuple(d if isinstance(d, int) else batch if d == "batch" else n for d in dims)
            if name.endswith("input_ids"):
                out[name] = rng.integers(0, VOCAB, sizes).astype(dtype)
            elif name == "attention_mask":
                mask = np.ones(sizes, dtype)
                if batch > 1:
                    pad = slice(0, n // 4) if self.kind == PREFILL else slice(n - n // 4, n)
                    mask[0, pad] = 0
                out[name] = mask
            else:
                out[name] = rng.standard_normal(sizes).astype(dtype)
        return out

    def describe(self, shape: tuple[int, int]) -> str:
        batch, n = shape
        if self.kind == DECODE:
            return f"{batch}×1, {n} cached"
        if self.kind == VISION:
            return f"{batch}×{n}²"
        if self.kind == AUDIO:
            return f"{batch}×{n} {'samples' if 'input_values' in self.recipe.inputs else 'frames'}"
        return f"{batch}×{n}"

    def _export_now(self) -> onnx.ModelProto:
        import torch

        source = self.exporter.removeprefix("ort-")
        model = self.build()
        if self.kind == DECODE:
            from tvmattn.models import hf_decoders

            proto = hf_decoders.export(model, source, past=True, past_len=ex.DECODE_EXPORT_PAST,
                                       max_len=4 * MAX_POSITIONS)
        else:
            r = self.recipe
            module = ex.wrap(model, r.inputs, r.output, r.call)
            args = tuple(torch.from_numpy(a) for a in _example(self).values())
            axes = {n: AXES[n] for n in r.inputs if n in AXES}
            proto = (ex.torchscript if source == "torchscript" else ex.dynamo)(module, args, list(r.inputs), axes)
        if self.exporter.startswith("ort-"):
            proto = ex.ort_optimized(proto, self.ort_type, self.width, self.heads)
        return proto


@functools.cache
def _exporters() -> str:
    """The versions that decide what an export holds (read without importing the packages)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "none"
    return "-".join(f"{p}{of(p)}" for p in ("torch", "transformers", "onnxruntime"))


def _example(m: ZooModel) -> dict[str, np.ndarray]:
    """The traced inputs: batch 2 of 8 tokens (with a padded key), or the recipe's image/audio shape."""
    rng = np.random.default_rng(0)
    out = {}
    for name in m.recipe.inputs:
        if name.endswith("input_ids"):
            out[name] = rng.integers(0, VOCAB, (2, TRACE_TOKENS))
        elif name == "attention_mask":
            out[name] = np.ones((2, TRACE_TOKENS), np.int64)
            out[name][0, 0 if m.kind == PREFILL else -1] = 0  # a real mask: no all-ones shortcut traced
        else:
            out[name] = rng.standard_normal((2, *m.recipe.example)).astype(np.float32)
    return out


def _cached(name: str) -> onnx.ModelProto:
    """Read from disk each time, not kept in memory: the whole zoo's weights are ~1 GB."""
    m = get(name)
    if m.path.exists():
        return onnx.load(m.path)
    proto = m._export_now()
    m.path.parent.mkdir(parents=True, exist_ok=True)
    partial = m.path.with_suffix(f".{os.getpid()}.part")
    onnx.save(proto, partial)
    os.replace(partial, m.path)  # a concurrent or killed export never leaves half a file under the name
    return proto


def graph_inputs(m: ZooModel) -> list[tuple[str, tuple[int | str, ...], np.dtype]]:
    """(name, dims, dtype) of each input of the export (initializers excluded): a dim is a size or a name."""
    return _graph_inputs(m.name)


@functools.cache
def _graph_inputs(name: str) -> list[tuple[str, tuple[int | str, ...], np.dtype]]:
    graph = get(name).export().graph
    weights = {t.name for t in graph.initializer}
    out = []
    for i in graph.input:
        if i.name in weights:
            continue
        t = i.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim)
        out.append((i.name, dims, onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)))
    return out


# ---- recipes ---------------------------------------------------------------------------------------
def _llama_like(**extra: Any) -> Callable[[int, int], dict[str, Any]]:
    """The config arguments most families share (Llama's names), 4·width MLPs, plus ``extra``."""
    def make(width: int, heads: int) -> dict[str, Any]:
        return dict(hidden_size=width, num_attention_heads=heads, num_hidden_layers=LAYERS, intermediate_size=4 * width,
                    vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, bos_token_id=0, eos_token_id=0,
                    pad_token_id=0) | extra
    return make


def _causal(config: str, make: Callable[[int, int], dict[str, Any]] | None = None, mask: bool = False,
            **extra: Any) -> Recipe:
    """A causal LM's logits, no cache (``use_cache=False``: the prefill as a one-shot graph)."""
    return Recipe("AutoModelForCausalLM", config, make or _llama_like(**extra),
                  ("input_ids", "attention_mask") if mask else ("input_ids",), call={"use_cache": False})


def _encoder(config: str, make: Callable[[int, int], dict[str, Any]] | None = None, **extra: Any) -> Recipe:
    return Recipe("AutoModel", config, make or _llama_like(**extra), ("input_ids", "attention_mask"),
                  "last_hidden_state")


def _seq2seq(config: str, make: Callable[[int, int], dict[str, Any]]) -> Recipe:
    return Recipe("AutoModelForSeq2SeqLM", config, make, ("input_ids", "attention_mask", "decoder_input_ids"),
                  call={"use_cache": False})


def _pixels(config: str, patch: int, **extra: Any) -> Recipe:
    """A vision encoder on 224² RGB images, patches by a stride = kernel convolution."""
    def make(width: int, heads: int) -> dict[str, Any]:
        return dict(hidden_size=width, num_attention_heads=heads, num_hidden_layers=LAYERS, intermediate_size=4 * width,
                    image_size=224, patch_size=patch) | extra
    return Recipe("AutoModel", config, make, ("pixel_values",), "last_hidden_state", example=(3, 224, 224))


def _gpt2(width: int, heads: int) -> dict[str, Any]:
    return dict(n_embd=width, n_head=heads, n_layer=LAYERS, vocab_size=VOCAB, n_positions=MAX_POSITIONS,
                bos_token_id=0, eos_token_id=0)


def _bloom(width: int, heads: int) -> dict[str, Any]:
    return dict(hidden_size=width, n_head=heads, n_layer=LAYERS, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
                pad_token_id=0)


def _gptj(width: int, heads: int) -> dict[str, Any]:
    return _gpt2(width, heads) | dict(rotary_dim=width // heads // 2)  # GPT-J-6B rotates 64 of 256


def _opt(width: int, heads: int) -> dict[str, Any]:
    return dict(hidden_size=width, num_attention_heads=heads, num_hidden_layers=LAYERS, ffn_dim=4 * width,
                word_embed_proj_dim=width, vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, bos_token_id=0,
                eos_token_id=0, pad_token_id=1)


def _gpt_bigcode(width: int, heads: int) -> dict[str, Any]:
    return dict(n_embd=width, n_head=heads, n_layer=LAYERS, vocab_size=VOCAB, n_positions=MAX_POSITIONS,
                multi_query=True, bos_token_id=0, eos_token_id=0)


def _marian(width: int, heads: int) -> dict[str, Any]:
    return dict(d_model=width, encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_layers=LAYERS,
                decoder_layers=LAYERS, encoder_ffn_dim=4 * width, decoder_ffn_dim=4 * width, vocab_size=VOCAB,
                max_position_embeddings=MAX_POSITIONS, pad_token_id=0, decoder_start_token_id=0)


def _distilbert(width: int, heads: int) -> dict[str, Any]:
    return dict(dim=width, n_heads=heads, n_layers=LAYERS, hidden_dim=4 * width, vocab_size=VOCAB, pad_token_id=0)


def _t5(width: int, heads: int) -> dict[str, Any]:
    return dict(d_model=width, d_kv=width // heads, num_heads=heads, d_ff=4 * width, num_layers=LAYERS,
                vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def _bart(width: int, heads: int) -> dict[str, Any]:
    return dict(d_model=width, encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_layers=LAYERS,
                decoder_layers=LAYERS, encoder_ffn_dim=4 * width, decoder_ffn_dim=4 * width, vocab_size=VOCAB,
                max_position_embeddings=MAX_POSITIONS, bos_token_id=0, eos_token_id=2, pad_token_id=1,
                decoder_start_token_id=2, forced_eos_token_id=None)


def _bart_like(width: int, heads: int) -> dict[str, Any]:
    """BART's config names, which Pegasus and M2M100 share (their own defaults for the forced EOS)."""
    own = {k: v for k, v in _bart(width, heads).items() if k != "forced_eos_token_id"}
    return own | dict(pad_token_id=0, decoder_start_token_id=0)


def _codegen(width: int, heads: int) -> dict[str, Any]:
    return _gpt2(width, heads) | dict(rotary_dim=width // heads // 4)  # a rotary over a part of each head


def _gpt_neo(width: int, heads: int) -> dict[str, Any]:  # GPT-Neo's layers alternate global and local
    return dict(hidden_size=width, num_heads=heads, num_layers=LAYERS, attention_types=[[["global", "local"], 1]],
                window_size=64, vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, bos_token_id=0, eos_token_id=0)


def _xglm(width: int, heads: int) -> dict[str, Any]:
    return dict(d_model=width, attention_heads=heads, num_layers=LAYERS, ffn_dim=4 * width, vocab_size=VOCAB,
                max_position_embeddings=MAX_POSITIONS, pad_token_id=1)


def _esm(width: int, heads: int) -> dict[str, Any]:  # ESM-2's protein encoder: rotary over 16-wide heads
    return _llama_like(mask_token_id=1, pad_token_id=1, position_embedding_type="rotary")(width, heads)


def _ctrl(width: int, heads: int) -> dict[str, Any]:
    return dict(n_embd=width, n_head=heads, n_layer=LAYERS, dff=4 * width, vocab_size=VOCAB, n_positions=MAX_POSITIONS)


def _mpt(width: int, heads: int) -> dict[str, Any]:  # ALiBi, no biases, no positions
    return dict(d_model=width, n_heads=heads, n_layers=LAYERS, expansion_ratio=4, vocab_size=VOCAB,
                max_seq_len=MAX_POSITIONS)


def _swin(width: int, heads: int) -> dict[str, Any]:  # two stages: windows of 7², then merged patches at ``width``
    return dict(embed_dim=width // 2, depths=[1, 1], num_heads=[heads // 2, heads], window_size=7, image_size=224,
                patch_size=4)


def _segformer(width: int, heads: int) -> dict[str, Any]:  # two stages: keys and values from strided convs
    return dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[8, 4], hidden_sizes=[width // 2, width],
                num_attention_heads=[heads // 2, heads], patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[4, 4],
                decoder_hidden_size=width)


WHISPER_FRAMES = 400  # 4 s of 10 ms mel frames: its encoder takes exactly 2 × max_source_positions


def _whisper(width: int, heads: int) -> dict[str, Any]:
    return dict(d_model=width, encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_layers=LAYERS,
                decoder_layers=LAYERS, encoder_ffn_dim=4 * width, decoder_ffn_dim=4 * width, vocab_size=VOCAB,
                num_mel_bins=80, max_source_positions=WHISPER_FRAMES // 2, max_target_positions=64,
                pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)


def _wav2vec2(width: int, heads: int) -> dict[str, Any]:
    return dict(hidden_size=width, num_attention_heads=heads, num_hidden_layers=LAYERS, intermediate_size=4 * width,
                vocab_size=32, do_stable_layer_norm=True, feat_extract_norm="layer")


def _sew(width: int, heads: int) -> dict[str, Any]:
    return {k: v for k, v in _wav2vec2(width, heads).items() if k != "do_stable_layer_norm"}


_TS_CAUSAL = ("torch 2.13's TorchScript exporter fails: without an attention_mask, transformers 5's mask "
              "builder looks for packed sequences with aten::diff, which it cannot export")
_ROPE = {"rope_theta": 10000.0, "rope_type": "default"}
_MOE = dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, experts_implementation="batched_mm")
_MOE_NOTE = ("transformers 5's default experts (grouped_mm) have no ONNX export, and its eager loop routes by "
             "data-dependent indices dynamo cannot export, nor TorchScript trace at other routings")

# ---- the catalogue -------------------------------------------------------------------------------
M = ZooModel
MODELS: list[ZooModel] = [
    # encoders, with a padding attention_mask
    M("bert", "BERT", "torchscript", ENCODER, 128, 2, _encoder("BertConfig")),  # BERT-tiny's width
    M("electra", "ELECTRA", "torchscript", ENCODER, 256, 4, _encoder("ElectraConfig", embedding_size=128)),
    M("distilbert", "DistilBERT", "torchscript", ENCODER, 768, 12, _encoder("DistilBertConfig", _distilbert)),
    M("roberta-ort", "RoBERTa", "ort-torchscript", ENCODER, 1024, 16,
      _encoder("RobertaConfig", max_position_embeddings=MAX_POSITIONS + 2, pad_token_id=1), ort_type="bert"),
    M("modernbert", "ModernBERT", "dynamo", ENCODER, 256, 4,
      _encoder("ModernBertConfig", local_attention=64, cls_token_id=0, sep_token_id=0)),
    M("deberta-v2", "DeBERTa-v2", "torchscript", ENCODER, 384, 6,
      _encoder("DebertaV2Config", relative_attention=True, position_buckets=256, pos_att_type=["p2c", "c2p"],
               position_biased_input=False, max_relative_positions=-1)),
    M("albert", "ALBERT", "torchscript", ENCODER, 256, 4, _encoder("AlbertConfig", embedding_size=128)),
    M("xlm-roberta", "XLM-R", "torchscript", ENCODER, 384, 6,
      _encoder("XLMRobertaConfig", max_position_embeddings=MAX_POSITIONS + 2, pad_token_id=1)),
    M("mpnet", "MPNet", "torchscript", ENCODER, 256, 4, _encoder("MPNetConfig")),
    M("roformer", "RoFormer", "torchscript", ENCODER, 256, 4, _encoder("RoFormerConfig")),  # rotary in an encoder
    M("convbert", "ConvBERT", "torchscript", ENCODER, 256, 4, _encoder("ConvBertConfig")),  # span convolutions
    M("mobilebert", "MobileBERT", "torchscript", ENCODER, 512, 4,  # 128-wide bottlenecks, trigram embedding
      _encoder("MobileBertConfig", intra_bottleneck_size=128, embedding_size=128, true_hidden_size=128)),
    M("megatron-bert", "MegatronBERT", "torchscript", ENCODER, 512, 8, _encoder("MegatronBertConfig")),
    M("esm", "ESM", "torchscript", ENCODER, 320, 20, _encoder("EsmConfig", _esm)),  # ESM-2 8M's shape
    M("squeezebert", "SqueezeBERT", "torchscript", ENCODER, 256, 4,  # grouped 1-wide convolutions for its GEMMs
      _encoder("SqueezeBertConfig", embedding_size=256)),
    # decoders: the prefill, logits of every position
    M("gpt2", "GPT-2", "dynamo", PREFILL, 768, 12, _causal("GPT2Config", _gpt2), _TS_CAUSAL),
    M("llama", "Llama", "torchscript", PREFILL, 512, 8, _causal("LlamaConfig", mask=True, num_key_value_heads=2)),
    M("mistral", "Mistral", "dynamo", PREFILL, 384, 6,
      _causal("MistralConfig", num_key_value_heads=2, sliding_window=64), _TS_CAUSAL),
    M("qwen2", "Qwen2", "dynamo", PREFILL, 896, 14, _causal("Qwen2Config", num_key_value_heads=2), _TS_CAUSAL),
    M("qwen3", "Qwen3", "dynamo", PREFILL, 256, 4, _causal("Qwen3Config", num_key_value_heads=2, head_dim=64),
      _TS_CAUSAL),
    M("phi", "Phi", "dynamo", PREFILL, 320, 4,  # Phi-2's shape: head 80, 40 % of it rotary, biased GEMMs
      _causal("PhiConfig", rope_parameters=_ROPE | {"partial_rotary_factor": 0.4}), _TS_CAUSAL),
    M("phi3", "Phi-3", "dynamo", PREFILL, 384, 6, _causal("Phi3Config"), _TS_CAUSAL),
    M("gemma2", "Gemma2", "dynamo", PREFILL, 256, 4,  # softcaps on scores and logits, a window on layer 0
      _causal("Gemma2Config", num_key_value_heads=2, head_dim=64, sliding_window=64), _TS_CAUSAL),
    M("olmo2", "OLMo2", "dynamo", PREFILL, 256, 4, _causal("Olmo2Config"), _TS_CAUSAL),
    M("starcoder2", "StarCoder2", "dynamo", PREFILL, 320, 5,
      _causal("Starcoder2Config", num_key_value_heads=1, sliding_window=64), _TS_CAUSAL),
    M("gpt-neox", "GPT-NeoX", "dynamo", PREFILL, 256, 4, _causal("GPTNeoXConfig"), _TS_CAUSAL),
    M("gptj", "GPT-J", "dynamo", PREFILL, 256, 4, _causal("GPTJConfig", _gptj), _TS_CAUSAL),
    M("falcon", "Falcon", "dynamo", PREFILL, 256, 4, _causal("FalconConfig"), _TS_CAUSAL),  # multi-query
    M("bloom", "BLOOM", "dynamo", PREFILL, 256, 4, _causal("BloomConfig", _bloom), _TS_CAUSAL),  # ALiBi
    M("opt", "OPT", "torchscript", PREFILL, 512, 8, _causal("OPTConfig", _opt)),
    M("gpt-bigcode", "GPTBigCode", "dynamo", PREFILL, 256, 4, _causal("GPTBigCodeConfig", _gpt_bigcode),
      _TS_CAUSAL),  # multi-query
    M("gemma", "Gemma", "dynamo", PREFILL, 256, 4, _causal("GemmaConfig", num_key_value_heads=1, head_dim=64),
      _TS_CAUSAL),
    M("granite", "Granite", "dynamo", PREFILL, 256, 4, _causal("GraniteConfig", num_key_value_heads=2), _TS_CAUSAL),
    M("codegen", "CodeGen", "dynamo", PREFILL, 256, 4, _causal("CodeGenConfig", _codegen), _TS_CAUSAL),
    M("gpt-neo", "GPT-Neo", "dynamo", PREFILL, 256, 4, _causal("GPTNeoConfig", _gpt_neo), _TS_CAUSAL),
    M("xglm", "XGLM", "dynamo", PREFILL, 256, 4, _causal("XGLMConfig", _xglm), _TS_CAUSAL),  # fairseq's form
    M("stablelm", "StableLM", "dynamo", PREFILL, 256, 4, _causal("StableLmConfig", num_key_value_heads=4),
      _TS_CAUSAL),
    M("cohere", "Cohere", "dynamo", PREFILL, 256, 4, _causal("CohereConfig", num_key_value_heads=2), _TS_CAUSAL),
    M("olmo", "OLMo", "dynamo", PREFILL, 256, 4, _causal("OlmoConfig"), _TS_CAUSAL),
    M("ctrl", "CTRL", "dynamo", PREFILL, 256, 4, _causal("CTRLConfig", _ctrl), _TS_CAUSAL),
    M("biogpt", "BioGPT", "dynamo", PREFILL, 256, 4, _causal("BioGptConfig"), _TS_CAUSAL),
    M("persimmon", "Persimmon", "dynamo", PREFILL, 256, 4,  # LayerNorms on q and k, a partial rotary
      _causal("PersimmonConfig", qk_layernorm=True), _TS_CAUSAL),
    M("gemma3", "Gemma3", "dynamo", PREFILL, 256, 4,
      _causal("Gemma3TextConfig", num_key_value_heads=2, head_dim=64, sliding_window=64), _TS_CAUSAL),
    M("smollm3", "SmolLM3", "dynamo", PREFILL, 256, 4, _causal("SmolLM3Config", num_key_value_heads=2), _TS_CAUSAL),
    M("mpt", "MPT", "dynamo", PREFILL, 256, 4, _causal("MptConfig", _mpt), _TS_CAUSAL),  # ALiBi, masked_fill over it
    # mixtures of experts, in the form transformers 5 exports (batched_mm: each token's experts gathered)
    M("mixtral", "Mixtral", "dynamo", PREFILL, 256, 4, _causal("MixtralConfig", **_MOE), _MOE_NOTE),
    M("gpt-oss", "GPT-OSS", "dynamo", PREFILL, 256, 4,  # attention sinks, a window on layer 0
      _causal("GptOssConfig", head_dim=64, sliding_window=64, **_MOE), _MOE_NOTE),
    # decode steps: one token against a cache (batch 1)
    M("gpt2-decode", "GPT-2", "torchscript", DECODE, 768, 12, _causal("GPT2Config", _gpt2)),
    M("qwen3-decode", "Qwen3", "dynamo", DECODE, 256, 4,
      _causal("Qwen3Config", num_key_value_heads=2, head_dim=64)),
    M("falcon-decode", "Falcon", "dynamo", DECODE, 256, 4, _causal("FalconConfig")),
    M("bloom-decode", "BLOOM", "dynamo", DECODE, 256, 4, _causal("BloomConfig", _bloom)),
    # encoder-decoders: encoder and decoder tokens of the same length
    M("t5", "T5", "torchscript", SEQ2SEQ, 256, 4, _seq2seq("T5Config", _t5)),
    M("bart", "BART", "dynamo", SEQ2SEQ, 256, 4, _seq2seq("BartConfig", _bart)),
    M("marian", "Marian", "dynamo", SEQ2SEQ, 256, 4, _seq2seq("MarianConfig", _marian)),
    M("pegasus", "Pegasus", "dynamo", SEQ2SEQ, 256, 4, _seq2seq("PegasusConfig", _bart_like)),
    M("m2m100", "M2M100", "dynamo", SEQ2SEQ, 256, 4, _seq2seq("M2M100Config", _bart_like)),
    M("mbart", "mBART", "dynamo", SEQ2SEQ, 256, 4, _seq2seq("MBartConfig", _bart_like)),
    M("mt5", "mT5", "torchscript", SEQ2SEQ, 256, 4, _seq2seq("MT5Config", _t5)),
    # vision: 224² images
    M("vit-ort", "ViT", "ort-torchscript", VISION, 384, 6, _pixels("ViTConfig", 16), ort_type="vit"),
    M("clip-vision", "CLIP", "dynamo", VISION, 256, 4, _pixels("CLIPVisionConfig", 32)),
    M("siglip-vision", "SigLIP", "torchscript", VISION, 768, 12,
      _pixels("SiglipVisionConfig", 16)),
    M("deit", "DeiT", "torchscript", VISION, 384, 6, _pixels("DeiTConfig", 16)),
    M("beit", "BEiT", "torchscript", VISION, 384, 6, _pixels("BeitConfig", 16, use_relative_position_bias=True)),
    M("dinov2", "DINOv2", "torchscript", VISION, 384, 6, _pixels("Dinov2Config", 14)),  # 16² patches of 14
    M("yolos", "YOLOS", "torchscript", VISION, 192, 3,  # YOLOS-tiny's shape, 10 detection tokens
      _pixels("YolosConfig", 16, num_detection_tokens=10, image_size=[224, 224])),
    M("swin", "Swin", "torchscript", VISION, 128, 8,
      Recipe("AutoModel", "SwinConfig", _swin, ("pixel_values",), "last_hidden_state", example=(3, 224, 224))),
    M("swinv2", "Swinv2", "torchscript", VISION, 128, 8,  # cosine attention: a learned scale a head
      Recipe("AutoModel", "Swinv2Config", _swin, ("pixel_values",), "last_hidden_state", example=(3, 224, 224))),
    M("segformer", "SegFormer", "torchscript", VISION, 128, 2,  # 3×3 depthwise convolutions in its MLPs
      Recipe("AutoModel", "SegformerConfig", _segformer, ("pixel_values",), "last_hidden_state",
             example=(3, 224, 224))),
    # audio: a convolution front end
    M("whisper-encoder", "Whisper", "torchscript", AUDIO, 384, 6,
      Recipe("AutoModel", "WhisperConfig", _whisper, ("input_features",), "last_hidden_state", part="get_encoder",
             example=(80, WHISPER_FRAMES)), own_shapes=((2, WHISPER_FRAMES),)),
    M("wav2vec2", "Wav2Vec2", "torchscript", AUDIO, 256, 4,
      Recipe("AutoModel", "Wav2Vec2Config", _wav2vec2, ("input_values",), "last_hidden_state", example=(16000,)),
      own_shapes=((2, 32000),)),  # 2 s at 16 kHz
    M("hubert", "HuBERT", "torchscript", AUDIO, 256, 4,
      Recipe("AutoModel", "HubertConfig", _wav2vec2, ("input_values",), "last_hidden_state", example=(16000,)),
      own_shapes=((2, 32000),)),
    M("wavlm", "WavLM", "torchscript", AUDIO, 256, 4,  # a gated relative-position bias on (B·h, n, n) scores
      Recipe("AutoModel", "WavLMConfig", _wav2vec2, ("input_values",), "last_hidden_state", example=(16000,)),
      own_shapes=((2, 32000),)),
    M("sew", "SEW", "torchscript", AUDIO, 256, 4,  # squeezed by pooling, upsampled and padded back
      Recipe("AutoModel", "SEWConfig", _sew, ("input_values",), "last_hidden_state", example=(16000,)),
      own_shapes=((2, 32000),)),
]
BY_NAME = {m.name: m for m in MODELS}


def get(name: str) -> ZooModel:
    if name not in BY_NAME:
        raise KeyError(f"no zoo model {name!r}: {', '.join(BY_NAME)}")
    return BY_NAME[name]


def select(spec: str | None = None) -> list[ZooModel]:
    """The models named in ``spec`` (comma-separated names, families or kinds, any case), or all."""
    if not spec:
        return list(MODELS)
    wanted = {w.strip().lower() for w in spec.split(",") if w.strip()}
    chosen = [m for m in MODELS if wanted & {m.name, m.family.lower(), m.kind}]
    unknown = wanted - {k for m in chosen for k in (m.name, m.family.lower(), m.kind)}
    if unknown:
        raise KeyError(f"no zoo model, family or kind {sorted(unknown)}: {', '.join(BY_NAME)}")
    return chosen

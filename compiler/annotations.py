"""The keys tvmattn writes into TVM's IR, and the attribute values it gives TVM's own keys, in one place:
the builders that write them and the passes and rules that read them import them from here."""

import re

# ---- tvmattn's own ------------------------------------------------------------------------------------
KEY_STAGE = "tvmattn.key_stage"  # block: a stage of the tensor expression that ranges over keys (tile skipping)
PADDED_AXES = "tvmattn.padded_axes"  # block: iterators whose tail its inputs are padded for
QUERY_AXIS = "tvmattn.query_axis"  # block: its iterator over queries (a copy into a query tile: `pad_query_tiles`)
# Block: a key stage whose iterators run over blocks of queries or keys (a tensorized block):
# "b=v_b_o,s=v_s_o*16,t=v_t_o*2" — batch v_b_o, queries 16·v_s_o + [0, 16), keys 2·v_t_o + [0, 2).
# Keys in blocks make every key stage compute whole blocks (the other keys of a block are hidden: 0).
KEY_BLOCKS = "tvmattn.key_blocks"
# Block: its loop over keys runs this many a step (unrolled), so every key stage computes whole blocks of them
KEY_STEP = "tvmattn.key_step"
KEEP_16BIT = "tvmattn.keep_16bit"  # block: its bf16 output keeps 16 bits (a copy FMAs widen as they load)
EXP2_COEFFICIENTS = "tvmattn.exp2_coefficients"  # function: `polynomial_math`'s p, for `vector_exp2`
AMX_TILES = "tvmattn.amx_tiles"  # loop: each iteration configures the AMX tiles (`x86_amx.tile_configuration`)
# loop: an accumulator block on tiles an iteration, its epilogue after its store (`interleave_tile_epilogues`)
TILE_BLOCKS = "tvmattn.tile_blocks"
CONSTANT_PARAMS = "tvmattn.constant_params"  # function: the parameters every call passes a constant
STACK_TILES = "tvmattn.stack_tiles"  # function: local buffers (by name) to allocate on the stack (`stack_tiles`)
WRITTEN_AS = "tvmattn.written_as"  # function: written scheduled, reported under this rule name (`experts`)
SPEC = "tvmattn.spec"  # function: a tuning workload's AttentionSpec (JSON), for the build workers

# ---- TVM's keys, as tvmattn sets them ------------------------------------------------------------------
TILE_FUNCTION = re.compile(r"(dyn_)?tile\d*")  # TOPI's tile, as TVM's ONNX importer names it (deduplicated)
OP_PATTERN = "op_pattern"  # function: relax's OpPatternKind, which FuseOps reads
INJECTIVE = 2  # kInjective: FuseOps fuses it into its consumers (a lookup in a small table)
OUT_ELEMWISE_FUSABLE = 4  # kOutEWiseFusable: its elementwise consumers fuse into it (TOPI's LayerNorm)
OPAQUE = 8  # kOpaque: FuseOps fuses nothing into or out of it (a scheduled kernel, a run-time check)
DISABLE_LOWER_BUILTIN = "disable_lower_builtin"  # allocation: an LLVM alloca, not TVM's workspace
IS_SCHEDULED = "tirx.is_scheduled"  # function: scheduled already (dlight and tvmattn's rules leave it)

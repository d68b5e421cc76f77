"""What the command lines offer, with no heavy imports (so that --help answers at once). The
tables that implement each choice check at import that they offer exactly these names."""
from __future__ import annotations

# --weights: the lossy formats (quant/formats.py), bf16p (lossless 12-bit packing, quant/packed.py)
# and gguf (a GGUF file's own quantized blocks kept as they are, quant/ggml.py)
LOSSY_FORMATS = ("int8", "fp8", "fp8b", "mxfp8", "int4", "nvfp4")
WEIGHT_FORMATS = (*LOSSY_FORMATS, "bf16p", "gguf")
# --kv-dtype (models/paged.py KV_DTYPES)
KV_DTYPES = ("int8", "fp8", "k8v4", "bf16p")
# GGUF block types kept as they are by --weights gguf, and what `infernix-bench shapes --weights` also
# takes as random blocks (pallas_kernels/ggml_blocks.py LAYOUT)
GGML_FORMATS = ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k", "iq4_xs")
# --attn-impl: the jnp reference (the CPU's default), the Pallas kernels (a GPU's), or the kernels in
# Pallas' interpret mode (slow; for checking them on the CPU)
ATTN_IMPLS = ("reference", "pallas", "pallas_interpret")
# --speculative (engine/spec/policy.py): auto drafts where it pays, ngram always when it finds a match,
# mtp from the checkpoint's multi-token prediction head (Qwen3-Next / Qwen3.5)
SPECULATIVE = ("auto", "off", "ngram", "mtp")
MTP_DEPTH = 3          # the MTP head's default draft (each chained step reads the LM head once more)
# the most draft nodes a row verifies at once (ancestor bits: one int32 per query)
MAX_DRAFT_NODES = 32

"""infernix-convert: a model (Hugging Face directory, GGUF file or alias) into a converted
checkpoint that `--model DST` serves: Orbax checkpoints written a decoder layer at a time (a model
larger than RAM converts), with the projections quantized to --weights, the tokenizer and config
beside them, and a manifest of every tensor's format, size and checksum (infernix.json).

  infernix-convert SRC DST [--weights int8|fp8|fp8b|mxfp8|int4|nvfp4|bf16p|gguf] [--dtype bfloat16]"""
from __future__ import annotations

import argparse
import sys

from scripts._common import run


def main(argv=None) -> int:
    from infernix_jax.choices import KV_DTYPES, WEIGHT_FORMATS
    p = argparse.ArgumentParser(prog="infernix-convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="a Hugging Face model directory, a .gguf file or an alias")
    p.add_argument("dst", help="a new directory for the converted checkpoint")
    p.add_argument("--weights", default=None, choices=WEIGHT_FORMATS,
                   help="quantize the projections to this format, pack them losslessly in 12 bits (bf16p, "
                        "with --dtype bfloat16), or keep a .gguf source's own blocks (gguf); default: keep "
                        "them in --dtype")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the tensors that stay unquantized (default %(default)s)")

    p.add_argument("--kv-dtype", default=None, choices=KV_DTYPES,
                   help="the KV cache dtype the checkpoint is served with by default (its manifest says so; "
                        "infernix-serve --kv-dtype overrides it, --kv-dtype model for the model dtype); "
                        "default: the model dtype")

    def go():
        a = p.parse_args(argv)
        from infernix_jax.weights.convert import convert
        m = convert(a.src, a.dst, weights=a.weights, dtype=a.dtype, kv_dtype=a.kv_dtype or "")
        n = len(m["tensors"])
        print(f"infernix-convert: wrote {a.dst}: {n} tensors, {m['total_bytes'] / 2**30:.2f} GiB "
              f"({m['weights'] or m['dtype']} projections{', KV ' + m['kv_dtype'] if m['kv_dtype'] else ''}) in "
              f"{m['seconds']} s; serve it with "
              f"infernix-serve --model {a.dst}")

    return run("infernix-convert", go)


if __name__ == "__main__":
    sys.exit(main())

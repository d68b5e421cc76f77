"""What every CLI shares: one-line errors with a non-zero exit instead of tracebacks."""
from __future__ import annotations

import os
import sys
from typing import Callable

from infernix_jax.config import ConfigError
from infernix_jax.tokenizer import TokenizerError
from infernix_jax.weights import ModelLoadError

USER_ERRORS = (ModelLoadError, ConfigError, TokenizerError, FileNotFoundError, PermissionError,
               IsADirectoryError, ValueError)


def run(prog: str, main: Callable[[], int | None]) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return main() or 0
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def add_model_args(p, default_model: str | None = None):
    from infernix_jax.hub import DEFAULT_MODEL
    p.add_argument("--model", default=default_model or DEFAULT_MODEL,
                   help="a Hugging Face model directory, a .gguf file, or an alias (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default float32: XLA's CPU bf16 matmuls are slow)")

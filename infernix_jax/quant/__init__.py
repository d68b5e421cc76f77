"""Quantized weight formats: the arrays, quantize / dequantize, and the reference matmul."""
from ..choices import WEIGHT_FORMATS          # what --weights takes
from .formats import FORMATS, QTensor, dequantize, quantize


def check_weights(weights: str | None, dtype: str, stored: str = "", where: str = "") -> None:
    """Raise ValueError if `--weights weights` cannot run in `dtype` on a model whose projections
    are already in format `stored` ("" when they are not; where: the model, for the message)."""
    if weights and weights not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weights!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if weights == "bf16p" and dtype != "bfloat16":
        raise ValueError("--weights bf16p packs bfloat16 weights losslessly: add --dtype bfloat16")
    if weights and stored and weights != stored:
        raise ValueError(f"{where} holds {stored} weights; --weights {weights} would round them twice: "
                         f"convert the source again with --weights {weights}")


__all__ = ["FORMATS", "QTensor", "WEIGHT_FORMATS", "check_weights", "dequantize", "quantize"]

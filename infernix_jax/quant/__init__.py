"""Quantized weight formats: the arrays, quantize / dequantize, and the reference matmul."""
from .formats import FORMATS, QTensor, dequantize, quantize  # noqa: F401

# what --weights takes: the lossy formats, and bf16p (lossless 12-bit packing, quant/packed.py)
WEIGHT_FORMATS = (*FORMATS, "bf16p")

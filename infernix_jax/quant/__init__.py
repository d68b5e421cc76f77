"""Quantized weight formats: the arrays, quantize / dequantize, and the reference matmul."""
from .formats import FORMATS, QTensor, dequantize, quantize  # noqa: F401

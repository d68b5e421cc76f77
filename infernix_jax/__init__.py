"""Infernix-JAX: an LLM inference engine for Qwen-family and Llama-architecture models on JAX."""
__version__ = "0.1.0"

"""Pallas kernels (attention, quantized matmuls, MoE experts), each beside its pure-jnp reference.
Kernels import nothing from the rest of the project and read no environment variables."""

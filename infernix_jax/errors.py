"""The errors a user can cause (a bad model, flag or file), in a module with no heavy imports: the
command-line tools catch them to print one line, and their --help must not wait for JAX."""
from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model that cannot be loaded; the message names the problem and the fix."""


class TokenizerError(ValueError):
    pass

"""Checkpoint readers. Each yields numpy arrays by our ParamSpec names; `materialize` turns the
declared params tree into device arrays of the compute dtype."""
from .common import ModelLoadError, materialize

__all__ = ["ModelLoadError", "materialize"]

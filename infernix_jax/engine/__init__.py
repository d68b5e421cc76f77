"""Host-side generation: requests, sampling parameters, the jitted steps and the engine loop."""
from .request import Event, Request, SamplingParams
from .config import EngineConfig
from .engine import Engine

__all__ = ["Engine", "EngineConfig", "Event", "Request", "SamplingParams"]

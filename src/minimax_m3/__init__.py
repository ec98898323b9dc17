"""MiniMax-M3 text backbone on AWS Trainium (NxD Inference) with a pure-PyTorch reference backend."""

from .config import ConfigError, M3Config
from .engine import Engine, EngineInputError, GenerationConfig, GenerationResult, load_engine

__all__ = [
    "ConfigError", "M3Config", "Engine", "EngineInputError", "GenerationConfig", "GenerationResult", "load_engine",
]
__version__ = "0.1.0"

"""The bottom layer: plain types every other package shares and that import none of them.

`api`: the engine contract (GenerateRequest, SamplingParams, Anchor, EngineEvent, AdmissionError,
EngineClient). `forward_batch`: the packed batch one forward pass runs. `model_config`: the model's
hyper-parameters read from an HF `config.json`.
"""
from freetoken.types.api import (
    AdmissionError,
    Anchor,
    EngineClient,
    EngineEvent,
    GenerateRequest,
    SamplingParams,
)
from freetoken.types.forward_batch import ForwardBatch
from freetoken.types.model_config import ConfigError, ModelConfig, config_from_dict, load_config

__all__ = [
    "AdmissionError", "Anchor", "ConfigError", "EngineClient", "EngineEvent", "ForwardBatch",
    "GenerateRequest", "ModelConfig", "SamplingParams", "config_from_dict", "load_config",
]

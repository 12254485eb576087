"""Models: checkpoint config, loading, tokenizer, the embedded tiny model, and the model families
(registry.py; one module per family, layers/ for their building blocks, kv_cache.py for the KV
layout a model declares)."""

from jengine.models.config import ModelConfig
from jengine.models.loader import LoadedModel, load_model
from jengine.models.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["ModelConfig", "LoadedModel", "load_model", "Tokenizer", "IncrementalDetokenizer"]

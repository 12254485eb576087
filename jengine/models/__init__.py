"""Models: checkpoint config, loading, tokenizer, and the embedded tiny model."""

from jengine.models.config import ModelConfig
from jengine.models.loader import LoadedModel, load_model
from jengine.models.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["ModelConfig", "LoadedModel", "load_model", "Tokenizer", "IncrementalDetokenizer"]

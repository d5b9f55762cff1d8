"""Models: config normalization, architectures over shared TP-aware layers,
the strict safetensors loader, dummy weights, the embedded GGUF default model,
name resolution, tokenizer + chat template + incremental detokenizer."""
from detent.models.config import ModelConfig
from detent.models.loader import load_model
from detent.models.resolve import ModelNotFound, ResolvedModel, resolve_model, resolve_tokenizer
from detent.models.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["IncrementalDetokenizer", "ModelConfig", "ModelNotFound", "ResolvedModel", "Tokenizer",
           "load_model", "resolve_model", "resolve_tokenizer"]

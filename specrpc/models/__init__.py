"""Models the engine runs: the CausalLM protocol and the loaders."""

from specrpc.models.batch import BatchRow
from specrpc.models.loader import load_model, load_tokenizer
from specrpc.models.protocol import CausalLM

__all__ = ["BatchRow", "CausalLM", "load_model", "load_tokenizer"]

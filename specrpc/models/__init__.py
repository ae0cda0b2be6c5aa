"""Models the engine runs: the CausalLM protocol, the loaders, and the padded sizes a CUDA-graphed model takes."""

from specrpc.models.batch import BatchRow
from specrpc.models.llama import padded_sizes
from specrpc.models.loader import load_model, load_tokenizer
from specrpc.models.protocol import CausalLM, execution_line

__all__ = ["BatchRow", "CausalLM", "execution_line", "load_model", "load_tokenizer", "padded_sizes"]

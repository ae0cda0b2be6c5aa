"""Models the engine runs: the CausalLM protocol, the loaders, the padded sizes a CUDA-graphed model takes, and how a
start's measurements are kept for the next (`Memo`) and judged still true (`Drift`)."""

from specrpc.models.backends.memo import Memo, checkpoint_identity
from specrpc.models.backends.timing import Drift
from specrpc.models.batch import BatchRow
from specrpc.models.llama import padded_sizes
from specrpc.models.loader import load_model, load_tokenizer
from specrpc.models.protocol import CausalLM, execution_line

__all__ = ["BatchRow", "CausalLM", "Drift", "Memo", "checkpoint_identity", "execution_line", "load_model",
           "load_tokenizer", "padded_sizes"]

"""raylm: an LLM inference and serving engine whose model-parallel workers run
as Ray actors. Offline use: `from raylm import LLM, SamplingParams`."""

__version__ = "0.1.0"

from raylm.engine.llm import LLM
from raylm.outputs import CompletionOutput, RequestOutput
from raylm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

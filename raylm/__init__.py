"""raylm: an LLM inference and serving engine whose model-parallel workers run
as Ray actors. Offline use: `from raylm import LLM, SamplingParams`."""

__version__ = "0.1.0"

# Before anything imports torch: its OpenMP runtime reads this once, at load.
from raylm.openmp_env import limit_openmp_spinning

limit_openmp_spinning()

from raylm.engine.llm import LLM  # noqa: E402
from raylm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from raylm.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

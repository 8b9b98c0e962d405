"""Test support: tiny deterministic HF model folders and the transformers oracle.

Used by every correctness test; not imported by the engine itself.
"""

from raylm.testing.hf_oracle import HFGeneration, hf_greedy, hf_logit_margins, hf_prompt_logprobs, load_hf_model
from raylm.testing.tiny_models import SUPPORTED_ARCHS, build_tiny_config, build_tiny_tokenizer, make_tiny_model

__all__ = [
    "HFGeneration",
    "SUPPORTED_ARCHS",
    "build_tiny_config",
    "build_tiny_tokenizer",
    "hf_greedy",
    "hf_logit_margins",
    "hf_prompt_logprobs",
    "load_hf_model",
    "make_tiny_model",
]

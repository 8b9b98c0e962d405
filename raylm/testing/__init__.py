"""Test support: the transformers oracle (hf_oracle) and tiny deterministic HF
model folders (tiny_models, with a tool-calling chat template), used by every
correctness test; GGUF files written as llama.cpp's converter writes them
(gguf_writer, with kquants' Q4_K/Q6_K encoders), the references of the
quantized-model checks (int8_reference, held_out); the chaos harness
(chaos/); and the runner of the docs' marked code blocks (doc_blocks). Not
imported by the engine itself.
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

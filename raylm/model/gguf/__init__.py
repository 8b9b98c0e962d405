"""GGUF model files (llama.cpp's format): read with the `gguf` package, the
format's own library. reader.py checks a file and turns its metadata into a
config; weights.py yields its tensors under Hugging Face names, quantized ones
as QuantizedWeight; tokenizer.py writes the tokenizer its metadata describes
into a folder, so the engine loads it like any other."""

from raylm.model.gguf.reader import GGUFFile, is_gguf_path, open_gguf
from raylm.model.gguf.tokenizer import materialize_tokenizer
from raylm.model.gguf.weights import iterate_gguf_weights

__all__ = ["GGUFFile", "is_gguf_path", "iterate_gguf_weights", "materialize_tokenizer", "open_gguf"]

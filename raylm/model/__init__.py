"""Model code: the architecture registry (registry, arch_config), the loader
that streams a rank's slice of safetensors or GGUF weights (loader; Hub ids
resolved in hub, generation defaults in generation_config) and the
Llama-family models (llama, with llama_decode running a CPU decode step's
layers in one C++ call).

Subpackages: layers/ (tensor-parallel layers, attention, and the C++ CPU
kernels in layers/csrc that layers/cpu_kernels.py builds at first use),
gguf/ (reading llama.cpp's GGUF files) and quantization/ (the quantized
block types and the weights the layers slice).
"""

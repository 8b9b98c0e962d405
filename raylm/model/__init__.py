"""Model code: the architecture registry, the safetensors loader and the
Llama-family models, built from the tensor-parallel layers in layers/."""

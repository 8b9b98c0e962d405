"""The device an engine runs on and the dtype it computes in: `detect_device`
(RAYLM_DEVICE, else CUDA where there is one), `resolve_device` (the user's
device, checked) and `resolve_dtype` (the user's dtype, or the checkpoint's,
for that device)."""

from __future__ import annotations

import os

import torch

DEVICES = ("cpu", "cuda")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


# Pins the default device ("cpu" or "cuda") where the engine's callers cannot
# pass one, e.g. the test suite on a GPU host keeps to CPU except tests/gpu.
DEVICE_ENV = "RAYLM_DEVICE"


def detect_device() -> str:
    pinned = os.environ.get(DEVICE_ENV, "").strip().lower()
    if pinned:
        if pinned not in DEVICES:
            raise ValueError(f"{DEVICE_ENV} must be 'cpu' or 'cuda', got {pinned!r}")
        return pinned
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(requested: str | None) -> str:
    """The device the user named, else the detected one."""
    device = requested or detect_device()
    if device not in DEVICES:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return device


def resolve_dtype(requested: str | torch.dtype, config_dtype: str | None, device: str) -> torch.dtype:
    """Turn the user's dtype (or "auto") into a torch dtype for this device.

    "auto" follows the checkpoint, except: float16 on CPU becomes bfloat16
    (CPU float16 matmuls are emulated and slow, and bf16 keeps fp32's range),
    and a float32 checkpoint on CUDA runs in bfloat16, as serving engines do,
    because fp32 halves throughput for no practical accuracy gain at inference.
    """
    if isinstance(requested, torch.dtype):
        dtype = requested
    elif requested == "auto":
        dtype = _DTYPES.get(str(config_dtype or "float32").replace("torch.", ""), torch.float32)
        if device == "cpu" and dtype == torch.float16:
            dtype = torch.bfloat16
        if device == "cuda" and dtype == torch.float32:
            dtype = torch.bfloat16
        return dtype
    else:
        if requested not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {requested!r}")
        dtype = _DTYPES[requested]
    if device == "cpu" and dtype == torch.float16:
        raise ValueError("dtype float16 is not supported on CPU; use bfloat16 or float32")
    return dtype

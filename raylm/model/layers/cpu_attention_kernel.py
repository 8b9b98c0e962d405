"""Builds and loads the C++ paged decode-attention kernel for CPU at first use.

The kernel (csrc/paged_decode_attention.cpp) is compiled once per machine type
with torch's JIT extension builder; when it cannot be built, callers get None
and keep the torch path. Set RAYLM_DISABLE_CPU_KERNELS=1 to force that path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "RAYLM_DISABLE_CPU_KERNELS"
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]
_LDFLAGS = ["-fopenmp"]

# The build is tried at most once per process.
_kernel: Callable | None = None
_attempted = False
_lock = threading.Lock()


def kernels_disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _cpu_signature() -> str:
    """What makes a -march=native binary specific to this machine and toolchain."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
                    break
    except OSError:
        pass  # not Linux: fall back on what platform knows
    return "|".join([platform.machine(), platform.processor(), flags])


def _extension_name() -> str:
    # A shared home directory may be mounted on machines with different CPUs,
    # Python or torch versions: each combination gets its own build.
    key = "|".join(
        [
            _cpu_signature(),
            torch.__version__,
            f"py{sys.version_info.major}.{sys.version_info.minor}",
            " ".join(_CFLAGS),
            hashlib.sha256(_SOURCE.read_bytes()).hexdigest(),
        ]
    )
    return "raylm_paged_decode_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _build_root() -> Path:
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "raylm" / "torch_extensions"


def _build() -> Callable:
    from torch.utils import cpp_extension

    name = _extension_name()
    build_dir = _build_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        # Said at warning level: the CLI's default log level would otherwise
        # leave a first run silent for the minute the compiler takes.
        logger.warning("building the CPU attention kernel (first run on this machine only, about a minute)")
    started = time.perf_counter()
    module = cpp_extension.load(
        name=name,
        sources=[str(_SOURCE)],
        extra_cflags=_CFLAGS,
        extra_ldflags=_LDFLAGS,
        build_directory=str(build_dir),
        verbose=False,
    )
    logger.info("CPU paged decode kernel ready (%s, %.1fs)", name, time.perf_counter() - started)
    return module.paged_decode


def get_paged_decode_kernel() -> Callable | None:
    """The compiled `paged_decode(q, kv_cache, block_table, context_lens, scale)`, or None.

    q [B, H, D], kv_cache [2, blocks, block_size, KVH, D] (contiguous),
    block_table [B, max_blocks] int64, context_lens [B] int64 -> [B, H, D] in q's dtype.
    Built once per process; failures are logged once and give None for good.
    """
    global _kernel, _attempted
    if kernels_disabled():
        return None
    if _attempted:
        return _kernel
    with _lock:
        if not _attempted:
            try:
                _kernel = _build()
            except Exception as e:  # no compiler, no ninja, a compile error: keep the torch path
                logger.warning("CPU paged decode kernel unavailable, using the torch path: %s", e)
                _kernel = None
            _attempted = True
    return _kernel

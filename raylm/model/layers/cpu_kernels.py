"""Builds and loads raylm's C++ CPU kernels at first use: paged decode
attention (csrc/paged_decode_attention.cpp), the fused elementwise ops of
the Llama block (csrc/elementwise_ops.cpp), matmuls on GGUF-quantized
weights (csrc/quant_gemm.cpp) and on packed bfloat16 weights for decode
(csrc/bf16_gemm.cpp), and a decode step's decoder layers in one call
(csrc/decode_layers.cpp): one extension module.

The module is compiled once per machine and environment with torch's JIT
extension builder; when it cannot be built (no compiler, a compile error,
another process building it for too long), callers get None and keep the
torch path. Set RAYLM_DISABLE_CPU_KERNELS=1 to force that path.

Builds never hang on a dead process: each build folder has a `raylm.lock` held
with flock(2), which the kernel releases when its holder dies, however it dies.
Only the holder builds, so it also clears the `lock` file that torch's own
FileBaton would leave behind after a kill (torch then waits on it forever).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import IO, Callable

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "RAYLM_DISABLE_CPU_KERNELS"
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = tuple(
    _CSRC / name
    for name in ("bindings.cpp", "paged_decode_attention.cpp", "elementwise_ops.cpp", "quant_gemm.cpp", "bf16_gemm.cpp",
                 "decode_layers.cpp")
)
# Headers the sources include: part of the build's identity too.
_HEADERS = (_CSRC / "fast_exp.h",)
# Tuples: torch appends its own flags to the lists it is given.
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast")
_LDFLAGS = ("-fopenmp",)
# How long to wait for another live process building the same kernel (a build
# takes about a minute) before going on with the torch path.
BUILD_WAIT_S = 300.0
_LOCK_NAME = "raylm.lock"

# The build is tried at most once per process.
_module: ModuleType | None = None
_attempted = False
_lock = threading.Lock()


class KernelUnavailable(Exception):
    """An expected reason to keep the torch path, said in one line."""


def kernels_disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _cpu_signature() -> str:
    """What makes a -march=native binary specific to this machine."""
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


def _compiler() -> tuple[str, str]:
    """(path, version line) of the C++ compiler torch will run: $CXX, else c++."""
    from torch.utils import cpp_extension

    cxx = cpp_extension.get_cxx_compiler()
    path = shutil.which(cxx)
    if path is None:
        where = "CXX=" + cxx if "CXX" in os.environ else "no c++ on PATH"
        raise KernelUnavailable(f"no C++ compiler ({where})")
    try:
        # Bounded: a wrapper script that hangs must not hang the engine.
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"C++ compiler {path} does not run ({e})") from None
    return os.path.realpath(path), (out.splitlines() or [""])[0]


def _extension_name(compiler: tuple[str, str]) -> str:
    # Everything the binary depends on is in the key, so machines sharing a home
    # directory, or virtual environments sharing a machine, each get their own
    # build folder instead of rebuilding one over each other. The torch include
    # path tells two environments with the same torch version apart. torch's
    # build files name the sources by path, so two checkouts (a clone beside
    # the working copy) would rebuild over each other: their paths are in it.
    from torch.utils import cpp_extension

    key = "|".join(
        [
            _cpu_signature(),
            torch.__version__,
            *cpp_extension.include_paths(),
            *compiler,
            sys.version,
            sysconfig.get_paths()["include"],
            " ".join(_CFLAGS),
            " ".join(_LDFLAGS),
            *(str(source.resolve()) for source in _SOURCES),
            *(hashlib.sha256(source.read_bytes()).hexdigest() for source in (*_SOURCES, *_HEADERS)),
        ]
    )
    return "raylm_cpu_kernels_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _build_root() -> Path:
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "raylm" / "torch_extensions"


def _holder(f: IO[str]) -> str:
    f.seek(0)
    return f.read().strip() or "?"


def _acquire_build_lock(build_dir: Path, wait_s: float) -> IO[str]:
    """Hold the folder's flock, waiting at most wait_s for a live holder.

    The file records the holder's pid while it holds it, for the messages here.
    """
    f = open(build_dir / _LOCK_NAME, "a+")
    start = time.monotonic()
    told = False
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            waited = time.monotonic() - start
            # Loading a built kernel holds the lock for well under a second
            # (e.g. tensor-parallel workers starting together): only a longer
            # wait is a build worth telling about.
            if not told and waited > 2:
                logger.warning(
                    "raylm: waiting for process %s, which is building the CPU kernels in %s",
                    _holder(f),
                    build_dir,
                )
                told = True
            if waited >= wait_s:
                holder = _holder(f)
                f.close()
                raise KernelUnavailable(f"process {holder} still builds it in {build_dir} after {wait_s:g}s") from None
            time.sleep(0.2)
    previous = _holder(f)
    if previous != "?":
        # A pid is only left behind by a holder that died before releasing.
        logger.info("taking over the CPU kernel build of process %s, which died during it", previous)
    # torch's FileBaton `lock` can only be stale now: only the flock holder builds.
    (build_dir / "lock").unlink(missing_ok=True)
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def _release_build_lock(f: IO[str]) -> None:
    f.seek(0)
    f.truncate()  # no pid left: the next holder knows this build ended cleanly
    f.close()  # closing drops the flock


def _compile(name: str, build_dir: Path):
    """torch's JIT build; tests replace this."""
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name=name,
        sources=[str(source) for source in _SOURCES],
        extra_cflags=list(_CFLAGS),
        extra_ldflags=list(_LDFLAGS),
        build_directory=str(build_dir),
        verbose=False,
    )


def _build() -> ModuleType:
    name = _extension_name(_compiler())
    build_dir = _build_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = _acquire_build_lock(build_dir, BUILD_WAIT_S)
    try:
        if not any(build_dir.glob("*.so")):
            # Said at warning level: the CLI's default log level would otherwise
            # leave a first run silent for the minute the compiler takes.
            logger.warning(
                "raylm: building the CPU kernels (first run on this machine, ~1 min) in %s", build_dir
            )
        started = time.perf_counter()
        module = _compile(name, build_dir)
    finally:
        _release_build_lock(lock)
    logger.info("CPU kernels ready (%s, %.1fs)", name, time.perf_counter() - started)
    return module


def get_cpu_kernels() -> ModuleType | None:
    """The compiled kernel module, or None (kernels disabled, or the build failed).

    Built once per process; failures are logged once and give None for good.
    """
    global _module, _attempted
    if kernels_disabled():
        return None
    if _attempted:
        return _module
    with _lock:
        if not _attempted:
            try:
                _module = _build()
            except Exception as e:  # no compiler, no ninja, a compile error: keep the torch path
                # One line, not the compiler's whole output (that goes to debug).
                logger.warning("raylm: CPU kernels unavailable, using the torch path: %s", _one_line(e))
                if not isinstance(e, KernelUnavailable):
                    logger.debug("CPU kernel build error", exc_info=True)
                _module = None
            _attempted = True
    return _module


def get_paged_decode_kernel() -> Callable | None:
    """The compiled `paged_decode(q, kv_cache, block_table, context_lens, scale)`, or None.

    q [B, H, D], kv_cache [2, blocks, block_size, KVH, D] (contiguous),
    block_table [B, max_blocks] int64, context_lens [B] int64 -> [B, H, D] in q's dtype.
    """
    module = get_cpu_kernels()
    return None if module is None else module.paged_decode


def _one_line(e: Exception) -> str:
    """The gist of a build error: the compiler's first error line if it has one."""
    lines = str(e).strip().splitlines() or [type(e).__name__]
    line = next((x for x in lines if "error:" in x), lines[0])
    return line.strip()[:300]


# Activation dtypes the fused elementwise kernels are built for.
_ELEMENTWISE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def elementwise_kernels_for(x: torch.Tensor) -> ModuleType | None:
    """The kernel module when it can run the fused elementwise ops on x (a CPU
    tensor of a float dtype), else None: the caller keeps its torch ops."""
    # Called by several layers per forward: is_cpu is the cheap device test.
    if not x.is_cpu or x.dtype not in _ELEMENTWISE_DTYPES:
        return None
    return get_cpu_kernels()

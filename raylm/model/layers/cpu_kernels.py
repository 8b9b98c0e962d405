"""Builds and loads raylm's C++ CPU kernels at first use: paged decode
attention (csrc/paged_decode_attention.cpp), the fused elementwise ops of
the Llama block (csrc/elementwise_ops.cpp), matmuls on GGUF-quantized
weights (csrc/quant_gemm.cpp; re-laid for decode by csrc/quant_pack.cpp and
read by csrc/quant_decode.cpp), on packed bfloat16 and int8 weights for
decode (csrc/bf16_gemm.cpp, csrc/int8_gemm.cpp), and a decode step's decoder
layers in one call (csrc/decode_layers.cpp): one extension module.

The module is compiled once per machine and environment with torch's JIT
extension builder; when it cannot be built (no compiler, a compile error,
another process building it for too long), callers get None and keep the
torch path. Set RAYLM_DISABLE_CPU_KERNELS=1 to force that path.

Once: the build folder's name covers everything that goes into torch's
compile and link commands (so every process that maps to a folder runs the
same commands there, however the engine was started) and the sources'
content; a finished build is marked so, and later processes import its
binary without torch's build step (ninja would rebuild on a moved file time).

Builds never hang on a dead process: each build folder has a `raylm.lock` held
with flock(2), which the kernel releases when its holder dies, however it dies.
Only the holder builds, so it also clears the `lock` file that torch's own
FileBaton would leave behind after a kill (torch then waits on it forever).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import IO

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "RAYLM_DISABLE_CPU_KERNELS"
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = tuple(
    _CSRC / name
    for name in (
        "bindings.cpp",
        "paged_decode_attention.cpp",
        "elementwise_ops.cpp",
        "quant_gemm.cpp",
        "bf16_gemm.cpp",
        "int8_gemm.cpp",
        "decode_layers.cpp",
        "quant_pack.cpp",
        "quant_decode.cpp",
        "work_team.cpp",
        "greedy_decode.cpp",
    )
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
# Written once a build of the folder's sources has finished (holds their digest).
_BUILT_NAME = "raylm.built"

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


def _source_paths() -> list[str]:
    """The sources as torch's build commands name them: real paths, so a process
    that imported raylm through a symlink or a relative path runs the same command."""
    return [str(source.resolve()) for source in _SOURCES]


def _content_digest() -> str:
    """What the compiler reads from this package: every source and header."""
    headers = sorted({*_HEADERS, *_CSRC.glob("*.h")})  # a header nobody listed still counts
    return hashlib.sha256(
        "|".join(hashlib.sha256(path.read_bytes()).hexdigest() for path in (*_SOURCES, *headers)).encode()
    ).hexdigest()


def _extension_name(compiler: tuple[str, str], content: str | None = None) -> str:
    # One build folder per command line: torch writes the commands into the
    # folder's build.ninja, and ninja rebuilds everything whenever a process
    # loads the folder with other commands than the last one. So everything
    # that goes into those commands is in the key (the compiler as spelled,
    # include and library paths, flags, source paths), and so is everything
    # the binary depends on beyond them (CPU, compiler version, torch and
    # Python versions, the sources' content): machines sharing a home
    # directory, virtual environments or checkouts sharing a machine each get
    # their own folder instead of rebuilding one over each other.
    from torch.utils import cpp_extension

    key = "|".join(
        [
            _cpu_signature(),
            torch.__version__,
            cpp_extension.get_cxx_compiler(),  # build.ninja's `cxx`: $CXX as spelled, else c++
            *compiler,  # what that spelling runs, and its version
            *cpp_extension.include_paths(),
            cpp_extension.TORCH_LIB_PATH,
            # Python.h's folder, asked for as torch asks for it (one scheme on every platform).
            str(sysconfig.get_path("include", scheme="posix_prefix")),
            sys.version,
            " ".join(_CFLAGS),
            " ".join(_LDFLAGS),
            *_source_paths(),
            content or _content_digest(),
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
        sources=_source_paths(),
        extra_cflags=list(_CFLAGS),
        extra_ldflags=list(_LDFLAGS),
        build_directory=str(build_dir),
        verbose=False,
    )


def _import_extension(name: str, path: Path) -> ModuleType:
    """Import a built extension module from its file (as torch's loader does)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_finished(name: str, build_dir: Path, content: str) -> ModuleType | None:
    """The module of a finished build of exactly these sources, or None.

    Loaded without torch's build step: ninja decides by file times, so a source
    whose time moved but whose content did not (a checkout, an editor saving
    unchanged text) would cost a whole rebuild; the folder's name and its
    `raylm.built` mark already say the binary is up to date.
    """
    try:
        if (build_dir / _BUILT_NAME).read_text() != content:
            return None
        return _import_extension(name, build_dir / f"{name}.so")
    except (OSError, ImportError) as e:  # no mark yet, or a binary that does not load: build
        if not isinstance(e, FileNotFoundError):
            logger.info("the CPU kernel build in %s does not load (%s); running torch's build step", build_dir, e)
        return None


def _mark_finished(build_dir: Path, content: str) -> None:
    if _content_digest() != content:
        # A source was edited while it compiled: the binary may be of either
        # version, so let the next process run torch's build step again.
        logger.info("CPU kernel sources changed during the build in %s; not marking it finished", build_dir)
        return
    partial = build_dir / f"{_BUILT_NAME}.{os.getpid()}"
    partial.write_text(content)
    partial.replace(build_dir / _BUILT_NAME)  # atomic: a reader sees no mark or the whole one


def _build() -> ModuleType:
    content = _content_digest()
    name = _extension_name(_compiler(), content)
    build_dir = _build_root() / name
    started = time.perf_counter()
    module = _load_finished(name, build_dir, content)
    if module is None:
        build_dir.mkdir(parents=True, exist_ok=True)
        lock = _acquire_build_lock(build_dir, BUILD_WAIT_S)
        try:
            module = _load_finished(name, build_dir, content)  # finished while we waited
            if module is None:
                if not any(build_dir.glob("*.so")):
                    # Said at warning level: the CLI's default log level would otherwise
                    # leave a first run silent for the minute the compiler takes.
                    logger.warning(
                        "raylm: building the CPU kernels (first run on this machine, ~1 min) in %s", build_dir
                    )
                module = _compile(name, build_dir)
                _mark_finished(build_dir, content)
        finally:
            _release_build_lock(lock)
    logger.info("CPU kernels ready (%s, %.1fs)", build_dir, time.perf_counter() - started)
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

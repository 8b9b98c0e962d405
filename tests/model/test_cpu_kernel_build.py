"""The CPU kernel's build never hangs and never fails loudly: a build killed
half-way is taken over, a live builder is waited for with a bound, no compiler
means the torch path with one warning, and each environment builds in its own
folder. The compile step is faked throughout: nothing here runs the compiler."""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils import cpp_extension
from torch.utils.file_baton import FileBaton

import raylm.model.layers.cpu_kernels as ck
from raylm import LLM, SamplingParams
from raylm.testing import make_tiny_model
from tests.conftest import wait_until

FAKE_COMPILER = ("/fake/bin/c++", "c++ (fake) 1.0")
_REAL_COMPILER = ck._compiler
_REAL_COMPILE = ck._compile


def _fake_kernel(*args):
    raise AssertionError("the fake kernel is never run")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The loader as in a new process, building under tmp_path with a fake compiler.

    Returns the list of build folders the fake compile step was called with.
    """
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv(ck.DISABLE_ENV, raising=False)
    monkeypatch.setattr(ck, "_module", None)  # restored afterwards: a kernel built by
    monkeypatch.setattr(ck, "_attempted", False)  # another test module stays loaded
    monkeypatch.setattr(ck, "_compiler", lambda: FAKE_COMPILER)
    built: list[Path] = []

    def fake_compile(name, build_dir):
        # As torch does: without its baton, it would wait for the file to vanish, forever.
        baton = FileBaton(str(build_dir / "lock"))
        assert baton.try_acquire(), "a stale torch lock was left in place"
        try:
            (build_dir / f"{name}.so").write_text("")
        finally:
            baton.release()
        built.append(build_dir)
        return SimpleNamespace(paged_decode=_fake_kernel)

    monkeypatch.setattr(ck, "_compile", fake_compile)
    return built


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _build_dir() -> Path:
    return ck._build_root() / ck._extension_name(FAKE_COMPILER)


_HANGING_BUILDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import raylm.model.layers.cpu_kernels as ck

    def hang(name, build_dir):
        (build_dir / "lock").touch()  # torch's FileBaton, taken before ninja runs
        Path(sys.argv[1]).touch()
        time.sleep(600)

    ck._compiler = lambda: ("/fake/bin/c++", "c++ (fake) 1.0")
    ck._compile = hang
    ck.get_paged_decode_kernel()
    """
)


def test_build_killed_half_way_is_taken_over(fresh, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=ck.__name__)
    # Were the flock not released by the kill, this would fail after 60s, not hang.
    monkeypatch.setattr(ck, "BUILD_WAIT_S", 60.0)
    marker = tmp_path / "building"
    child = subprocess.Popen([sys.executable, "-c", _HANGING_BUILDER, str(marker)])
    try:

        def building() -> bool:
            assert child.poll() is None, "the builder subprocess exited early"
            return marker.exists()

        wait_until(building, 300, step=0.1, message="the builder subprocess to start building")
        lock_file = _build_dir() / ck._LOCK_NAME
        assert lock_file.read_text().strip() == str(child.pid)
        assert (_build_dir() / "lock").exists()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()

    assert ck.get_paged_decode_kernel() is _fake_kernel
    assert fresh == [_build_dir()]
    assert not (_build_dir() / "lock").exists()
    assert lock_file.read_text() == "", "a clean release leaves no pid behind"
    assert any(f"process {child.pid}, which died" in r.getMessage() for r in caplog.records)
    assert not any("waiting for process" in m for m in _warnings(caplog))


def test_live_builder_is_waited_for_with_a_bound(fresh, monkeypatch, caplog):
    monkeypatch.setattr(ck, "BUILD_WAIT_S", 0.3)
    _build_dir().mkdir(parents=True)
    with open(_build_dir() / ck._LOCK_NAME, "a+") as holder:
        ck.fcntl.flock(holder, ck.fcntl.LOCK_EX)  # another open file: conflicts even in this process
        holder.write("4242")
        holder.flush()
        assert ck.get_paged_decode_kernel() is None
    assert fresh == []
    [warning] = _warnings(caplog)
    assert "using the torch path" in warning and "process 4242 still builds it" in warning
    # Given up for this process: no second wait.
    assert ck.get_paged_decode_kernel() is None and len(_warnings(caplog)) == 1


def test_builder_finishing_during_the_wait_lets_it_proceed(fresh, monkeypatch):
    monkeypatch.setattr(ck, "BUILD_WAIT_S", 120.0)
    _build_dir().mkdir(parents=True)
    holder = open(_build_dir() / ck._LOCK_NAME, "a+")
    ck.fcntl.flock(holder, ck.fcntl.LOCK_EX)
    threading.Timer(0.5, holder.close).start()
    assert ck.get_paged_decode_kernel() is _fake_kernel
    assert fresh == [_build_dir()]


_FALSE = shutil.which("false")


@pytest.fixture
def no_compiler(fresh, monkeypatch, tmp_path):
    """PATH without any compiler, and the real compiler lookup."""
    monkeypatch.setattr(ck, "_compiler", _REAL_COMPILER)
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CXX", raising=False)
    return fresh


@pytest.mark.parametrize(
    "cxx,reason",
    [(None, "no c++ on PATH"), ("/nonexistent/g++", "CXX=/nonexistent/g++"), (_FALSE, "does not run")],
    ids=["no-c++-on-path", "cxx-missing", "cxx-fails"],
)
def test_no_compiler_falls_back_with_one_warning(no_compiler, monkeypatch, caplog, recwarn, cxx, reason):
    if cxx is not None:
        monkeypatch.setenv("CXX", cxx)
    assert ck.get_paged_decode_kernel() is None
    assert ck.get_paged_decode_kernel() is None  # tried once per process
    [warning] = _warnings(caplog)
    assert "using the torch path" in warning and reason in warning
    assert not recwarn.list
    assert no_compiler == [], "nothing was built"


def test_failed_build_is_one_short_warning(fresh, monkeypatch, caplog):
    output = "[1/2] c++ -MMD -O3 ... paged_decode_attention.cpp\n" + "noise\n" * 200
    output += "paged_decode_attention.cpp:12:3: error: 'foo' was not declared in this scope\n" + "more noise\n" * 200

    def failing_compile(name, build_dir):
        raise RuntimeError(f"Error building extension '{name}': {output}")

    monkeypatch.setattr(ck, "_compile", failing_compile)
    assert ck.get_paged_decode_kernel() is None
    building, unavailable = _warnings(caplog)
    assert building.startswith("raylm: building the CPU kernels (first run")
    assert "using the torch path" in unavailable and "error: 'foo' was not declared" in unavailable
    assert "\n" not in unavailable and len(unavailable) < 500
    # A failed build releases the lock cleanly: the next process builds at once.
    assert (_build_dir() / ck._LOCK_NAME).read_text() == ""


def test_engine_generates_without_compiler(no_compiler, tmp_path, monkeypatch, caplog):
    model = make_tiny_model("llama", tmp_path / "m", seed=3)
    asked = []

    def spy():
        asked.append(1)
        return ck.get_paged_decode_kernel()

    monkeypatch.setattr("raylm.model.layers.attention.get_paged_decode_kernel", spy)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(model), dtype="float32", kv_cache_memory_bytes=16 << 20) as llm:
        [out] = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 6
    assert asked, "decode never consulted the CPU kernel loader"
    assert ck._attempted and ck._module is None
    [warning] = [m for m in _warnings(caplog) if "CPU kernels" in m]
    assert "no C++ compiler" in warning


def test_environments_get_their_own_build_folders(fresh, monkeypatch, tmp_path):
    """Two virtual environments (here: two torch include paths) never share a folder."""
    ck.get_paged_decode_kernel()
    monkeypatch.setattr(ck, "_attempted", False)
    real_includes = cpp_extension.include_paths()
    monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, **k: ["/other/venv/torch/include"])
    ck.get_paged_decode_kernel()
    first, second = fresh
    assert first != second and first.parent == second.parent == ck._build_root()

    # Each input of the build changes the folder; the same inputs keep it.
    monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, **k: real_includes)
    base = ck._extension_name(FAKE_COMPILER)
    source = tmp_path / "edited.cpp"
    source.write_bytes(ck._SOURCES[-1].read_bytes() + b"// edited\n")
    assert ck._extension_name(FAKE_COMPILER) == base
    assert ck._extension_name(("/usr/bin/clang++", FAKE_COMPILER[1])) != base
    assert ck._extension_name((FAKE_COMPILER[0], "c++ (fake) 2.0")) != base
    variants = [
        (ck, "_CFLAGS", [*ck._CFLAGS, "-DX"]),
        (ck, "_LDFLAGS", [*ck._LDFLAGS, "-lm"]),
        (ck, "_cpu_signature", lambda: "x86_64||other flags"),
        (torch, "__version__", "0.0.0"),
        (ck.sys, "version", "3.99.0"),
        (ck, "_SOURCES", (*ck._SOURCES[:-1], source)),
        (ck, "_HEADERS", (source,)),
    ]
    for obj, attr, value in variants:
        with monkeypatch.context() as m:
            m.setattr(obj, attr, value)
            assert ck._extension_name(FAKE_COMPILER) != base, attr


def test_torch_appending_flags_does_not_move_the_folder(fresh, monkeypatch):
    # torch's load() appends its libraries to the extra_ldflags list it is given.
    def load(**kwargs):
        kwargs["extra_ldflags"] += ["-ltorch"]
        return SimpleNamespace(paged_decode=_fake_kernel)

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(ck, "_compile", _REAL_COMPILE)
    before = _build_dir()
    assert ck.get_paged_decode_kernel() is _fake_kernel
    assert _build_dir() == before

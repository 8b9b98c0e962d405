"""One build folder per command line, and a finished build is loaded as it is.

torch writes the compile and link commands into the build folder's build.ninja;
ninja rebuilds the folder whenever a process loads it with other commands than the
last one, or when a source's file time moved. So everything torch puts into the
commands must be in the folder's key, and a finished build of the folder's sources
is imported without torch's build step. The compile step is faked throughout."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.utils import cpp_extension

import raylm.model.layers.cpu_kernels as ck
from tests.model.test_cpu_kernel_build import _REAL_COMPILE, FAKE_COMPILER, fresh  # noqa: F401  (fixture)


def _key() -> str:
    return ck._extension_name(FAKE_COMPILER)


def test_every_command_input_is_in_the_key(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    base = _key()
    # The same compiler binary spelled another way is another command line
    # (the case of a driver with CXX=g++ whose Ray actors have no CXX).
    monkeypatch.setenv("CXX", "g++")
    assert _key() != base
    monkeypatch.delenv("CXX")
    assert _key() == base
    with monkeypatch.context() as m:
        m.setattr(cpp_extension, "TORCH_LIB_PATH", "/other/torch/lib")
        assert _key() != base, "-L of the link command"
    real_get_path = sysconfig.get_path
    with monkeypatch.context() as m:
        m.setattr(
            ck.sysconfig,
            "get_path",
            lambda name, *a, **k: "/other/include" if name == "include" else real_get_path(name, *a, **k),
        )
        assert _key() != base, "Python.h's folder, as torch asks for it"


def test_an_unlisted_header_is_part_of_the_key(monkeypatch, tmp_path):
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for source in ck._SOURCES:
        (csrc / source.name).write_bytes(source.read_bytes())
    monkeypatch.setattr(ck, "_CSRC", csrc)
    monkeypatch.setattr(ck, "_SOURCES", tuple(csrc / s.name for s in ck._SOURCES))
    monkeypatch.setattr(ck, "_HEADERS", ())
    base = _key()
    (csrc / "new_helper.h").write_text("// included by a source nobody listed it for\n")
    assert _key() != base


def test_sources_are_compiled_by_their_real_paths(monkeypatch, tmp_path):
    """A process that imported raylm through a symlinked path runs the same
    commands, in the same folder, as one that imported it by its real path."""
    link = tmp_path / "linked_csrc"
    link.symlink_to(ck._CSRC.resolve(), target_is_directory=True)
    seen = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: seen.append(kwargs["sources"]))
    real_key = _key()
    _REAL_COMPILE("x", tmp_path)
    with monkeypatch.context() as m:
        m.setattr(ck, "_SOURCES", tuple(link / s.name for s in ck._SOURCES))
        assert _key() == real_key
        _REAL_COMPILE("x", tmp_path)
    assert seen[0] == seen[1] == [str(s.resolve()) for s in ck._SOURCES]


@pytest.fixture
def imports(monkeypatch):
    """Imports of finished builds, recorded instead of loading the fake (empty) binary."""
    loaded: list[Path] = []

    def fake_import(name, path):
        loaded.append(path)
        return SimpleNamespace(paged_decode=f"loaded {name}")

    monkeypatch.setattr(ck, "_import_extension", fake_import)
    return loaded


def _new_process(monkeypatch):
    monkeypatch.setattr(ck, "_module", None)
    monkeypatch.setattr(ck, "_attempted", False)


def test_a_finished_build_is_loaded_without_the_build_step(fresh, imports, monkeypatch):  # noqa: F811
    first = ck.get_cpu_kernels()
    [build_dir] = fresh
    assert (build_dir / ck._BUILT_NAME).read_text() == ck._content_digest()
    assert imports == [], "a new build comes from torch's loader"
    assert first.paged_decode is not None

    for _ in range(2):  # two more processes of any kind: no build step at all
        _new_process(monkeypatch)
        module = ck.get_cpu_kernels()
        assert module.paged_decode == f"loaded {build_dir.name}"
    assert fresh == [build_dir]
    assert imports == [build_dir / f"{build_dir.name}.so"] * 2


def test_a_mark_of_other_sources_is_not_trusted(fresh, imports, monkeypatch):  # noqa: F811
    ck.get_cpu_kernels()
    [build_dir] = fresh
    (build_dir / ck._BUILT_NAME).write_text("digest of other sources")
    _new_process(monkeypatch)
    ck.get_cpu_kernels()
    assert fresh == [build_dir, build_dir] and imports == []
    assert (build_dir / ck._BUILT_NAME).read_text() == ck._content_digest()


def test_sources_edited_during_the_build_leave_no_mark(fresh, imports, monkeypatch):  # noqa: F811
    real_digest = ck._content_digest
    calls = iter([real_digest(), "the sources after an edit"])
    monkeypatch.setattr(ck, "_content_digest", lambda: next(calls))
    ck.get_cpu_kernels()
    [build_dir] = fresh
    assert not (build_dir / ck._BUILT_NAME).exists()
    monkeypatch.setattr(ck, "_content_digest", real_digest)
    _new_process(monkeypatch)
    ck.get_cpu_kernels()
    assert fresh == [build_dir, build_dir], "the next process runs the build step again"


def test_a_finished_binary_that_does_not_load_goes_to_the_build_step(fresh, monkeypatch):  # noqa: F811
    ck.get_cpu_kernels()
    [build_dir] = fresh
    _new_process(monkeypatch)  # the fake build's binary is an empty file: importing it fails
    assert ck.get_cpu_kernels() is not None
    assert fresh == [build_dir, build_dir]

"""What the CPU-kernel tests share: they are skipped where no C++ compiler can
build the kernels (where one is, the kernels must build: see conftest's
`kernels` fixture)."""

from __future__ import annotations

import shutil
import sysconfig

import pytest

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++", sysconfig.get_config_var("CXX") or "c++"))
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler to build the CPU kernels")

from __future__ import annotations

import pytest

from raylm.model.layers.cpu_kernels import get_cpu_kernels


@pytest.fixture(scope="module")
def kernels():
    """The built CPU kernel module (tests that use it are marked needs_compiler)."""
    module = get_cpu_kernels()
    assert module is not None, "a C++ compiler is present, so the kernels must build"
    return module

"""Packed weights ask the OS for 2 MiB pages
(csrc/huge_pages.h): checked in /proc/self/smaps, where the OS's setting of
transparent huge pages lets them be asked for ("madvise" or "always")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model.cpu_kernel_utils import needs_compiler

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")

pytestmark = [
    needs_compiler,
    pytest.mark.skipif(
        not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(),
        reason="the OS gives no transparent huge pages here",
    ),
]


def _huge_kib_under(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds t's memory, in KiB."""
    address, inside = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_packed_weights_sit_on_huge_pages(kernels):
    weight = torch.randn(4096, 2048).to(torch.bfloat16)  # 16 MiB packed
    packed = kernels.bf16_pack(weight)
    assert _huge_kib_under(packed) >= 2048
    quantized = kernels.int8_pack(torch.randint(-127, 128, (8192, 2048), dtype=torch.int8))
    assert _huge_kib_under(quantized) >= 2048

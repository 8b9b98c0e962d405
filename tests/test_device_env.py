"""RAYLM_DEVICE pins the default device (the suite sets it to cpu, tests/gpu to cuda)."""

from __future__ import annotations

import pytest

from raylm.config import DEVICE_ENV, detect_device


def test_suite_is_pinned_to_cpu():
    assert detect_device() == "cpu"


def test_env_pins_and_rejects_unknown_devices(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, "CUDA")
    assert detect_device() == "cuda"
    monkeypatch.setenv(DEVICE_ENV, "tpu")
    with pytest.raises(ValueError, match=DEVICE_ENV):
        detect_device()

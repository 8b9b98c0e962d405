"""Fixtures of the worker tests."""

from __future__ import annotations

import threading

import pytest

from raylm.kv_transfer import network as kv_network


@pytest.fixture
def endpoint():
    """A rank's K/V network endpoint, closed after the test with its server's threads."""
    ep = kv_network.KVNetworkEndpoint()
    yield ep
    ep.close()
    left = [t.name for t in threading.enumerate() if t.name in ("raylm-kv-server", "raylm-kv-sent")]
    assert not left, f"the server's threads live on: {left}"

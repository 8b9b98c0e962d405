"""Two hosts made of network namespaces, each with a Ray node (harness.py),
torn down even when a test fails. Without root, `ip` or network namespaces
the tests skip, saying which. One cluster at a time: a 2-core machine runs two
Ray nodes and four ranks already (a module's `hosts` is gone before the next
module starts)."""

from __future__ import annotations

import pytest

from tests.multinode.harness import FAST_NODE_DEATH, netns_unavailable, two_hosts


def _skip_without_netns() -> None:
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(f"two-host tests: {reason}")


@pytest.fixture(scope="module")
def hosts():
    """One cluster for a module's tests, none of which harms it. Ray's own
    node health checks: the fast ones the node-loss test needs declared a
    live but busy host dead (cgraph's spinning readers on two cores)."""
    _skip_without_netns()
    with two_hosts() as h:
        yield h


@pytest.fixture
def fresh_hosts():
    """A cluster of the test's own, for a test that breaks it."""
    _skip_without_netns()
    with two_hosts(FAST_NODE_DEATH) as h:
        yield h

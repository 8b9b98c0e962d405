"""The harness's own promise: a SIGTERM (timeout's, a CI runner's) inside
`two_hosts` unwinds through its teardown instead of leaving namespaces and
Ray nodes behind. Checked on `sigterm_unwinds`, which `two_hosts` runs in,
in a child process (no namespaces needed)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent("""
    import os, signal, time
    from tests.multinode.harness import sigterm_unwinds
    try:
        with sigterm_unwinds():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
            print("not stopped")
    finally:
        print("torn down", flush=True)
""")


def test_sigterm_inside_two_hosts_runs_its_teardown():
    child = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60)
    assert child.stdout.split() == ["torn", "down"], (child.stdout, child.stderr)
    assert child.returncode == 128 + signal.SIGTERM, child.stderr


def test_outside_it_sigterm_is_left_alone():
    from tests.multinode.harness import sigterm_unwinds

    before = signal.getsignal(signal.SIGTERM)
    with sigterm_unwinds():
        pass
    assert signal.getsignal(signal.SIGTERM) == before

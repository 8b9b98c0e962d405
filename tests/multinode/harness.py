"""Real Ray processes for tests: a head started with `ray start` on this
machine, and two "hosts" made of Linux network namespaces joined by a veth
pair, each running its own Ray node on its own address.

Everything started here is found again by something only it has, never by a
process name: a `ray start` runs in a session of its own (its processes keep
that session id, the workers Ray forks included), and every process of a
namespace host is listed by `ip netns pids`. Teardown kills exactly those, so
other Ray instances on the machine (the test session's, other people's) live on.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import psutil

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RAY = os.path.join(os.path.dirname(sys.executable), "ray")
# Namespace hosts (and their interfaces) are named
# PREFIX<pid of the test process>_<cluster number><role>, at most 15
# characters: a crashed run's leftovers are recognised (their pid is gone)
# and removed by the next run.
NETNS_PREFIX = "rlm"
_cluster_numbers = itertools.count()
HEAD_IP, WORKER_IP = "10.99.0.1", "10.99.0.2"
# A second network on the head host that carries its default route: a driver
# that guessed its address from the routes (or the host name) would get this
# one, not the Ray node IP.
OTHER_HEAD_IP = "10.98.0.1"
RAY_PORT = 6379  # each namespace has its own ports
# The GCS declares a lost node dead after period x threshold (Ray's defaults
# take ~30 s); the node-loss test needs it in seconds.
FAST_NODE_DEATH = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def short_tempdir(prefix: str) -> str:
    # Ray puts unix sockets under its temp dir: the path must stay short.
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def kill_pids(pids, timeout: float = 10.0) -> None:
    """SIGKILL each pid and wait until it is gone (or a zombie)."""
    procs = []
    for pid in set(pids):
        if pid == os.getpid():
            continue
        try:
            p = psutil.Process(pid)
            p.kill()
            procs.append(p)
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=timeout)


def session_pids(sid: int) -> list[int]:
    pids = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == sid:
                pids.append(pid)
        except OSError:
            pass
    return pids


def kill_session(sid: int) -> None:
    """Kill every process of session `sid` (a `ray start` and all it spawned)."""
    for _ in range(5):
        pids = session_pids(sid)
        if not pids:
            return
        kill_pids(pids)


def ray_alive_at(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


@dataclass
class LocalHead:
    address: str
    temp_root: str  # RAY_TMPDIR: Ray's temp dir (and cluster file) is temp_root/ray
    sid: int

    def alive(self) -> bool:
        return ray_alive_at(self.address)


@contextmanager
def local_ray_head(temp_root: str, num_cpus: int = 4):
    """`ray start --head` on this machine with its own temp dir (RAY_TMPDIR)
    and free ports; killed (its whole session) on exit."""
    gcs, client, agent, metrics, runtime_env = free_ports(5)
    env = dict(os.environ, RAY_TMPDIR=temp_root)
    env.pop("RAY_ADDRESS", None)
    cmd = [
        _RAY,
        "start",
        "--head",
        f"--num-cpus={num_cpus}",
        "--disable-usage-stats",
        "--include-dashboard=false",
        f"--port={gcs}",
        f"--ray-client-server-port={client}",
        f"--dashboard-agent-listen-port={agent}",
        f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime_env}",
    ]
    proc = subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start --head failed ({proc.returncode}):\n{out[-3000:]}")
        with open(os.path.join(temp_root, "ray", "ray_current_cluster")) as f:
            address = f.read().strip()
        yield LocalHead(address, temp_root, proc.pid)
    finally:
        proc.kill()
        kill_session(proc.pid)


# ---- two hosts in network namespaces ------------------------------------------------


def netns_unavailable() -> str | None:
    """Why namespace hosts cannot be made here, or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    probe = f"{NETNS_PREFIX}probe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def netns_pids(name: str) -> list[int]:
    r = _ip("netns", "pids", name, check=False)
    return [int(x) for x in r.stdout.split()] if r.returncode == 0 else []


def kill_netns_processes(name: str) -> None:
    for _ in range(5):
        pids = netns_pids(name)
        if not pids:
            return
        kill_pids(pids)


def _host_temp_dir(name: str) -> str:
    # Named after the host, so a crashed run's is found with its namespace.
    path = os.path.join("/tmp", name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def set_link(netns: str, up: bool) -> None:
    """Namespace host `netns`'s end of the hosts' link (named as the host)
    up or down. Both ends down is a partition as a pulled cable makes it:
    neither host reaches the other, TCP connections retransmit and live on
    if it ends before they give up, new connections are refused."""
    _ip("-n", netns, "link", "set", netns, "up" if up else "down")


def remove_netns(name: str) -> None:
    kill_netns_processes(name)
    _ip("netns", "del", name, check=False)  # takes its veth (and so the peer) along
    shutil.rmtree(os.path.join("/tmp", name), ignore_errors=True)


def remove_stale_netns() -> None:
    """Namespaces left by a test process that died before its teardown."""
    r = _ip("netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(NETNS_PREFIX) or name.startswith(NETNS_PREFIX + "probe"):
            continue
        digits = name[len(NETNS_PREFIX) :].split("_")[0]
        if digits.isdigit() and not psutil.pid_exists(int(digits)):
            remove_netns(name)


@dataclass
class NetnsHost:
    name: str
    ip: str
    temp_dir: str  # RAY_TMPDIR of this host: Ray's temp dir is temp_dir/ray
    cpus: str | None = None  # the CPUs every process of this host runs on (taskset's list); None: all

    def cmd(self, *args: str) -> list[str]:
        pinned = ["taskset", "-c", self.cpus] if self.cpus is not None else []
        return ["ip", "netns", "exec", self.name, *pinned, *args]


@dataclass
class TwoHosts:
    head: NetnsHost
    worker: NetnsHost
    address: str
    last_stderr: str = ""

    def driver_env(self) -> dict:
        env = dict(os.environ)
        for key in ("RAY_ADDRESS", "RAYLM_ALLOW_SHARED_NODE_IP", "GLOO_SOCKET_IFNAME"):
            env.pop(key, None)
        env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        # Ray's cluster file of the head host, as `ray start` left it there.
        env["RAY_TMPDIR"] = self.head.temp_dir
        return env

    def run_driver(self, spec: dict, timeout: float, module: str = "tests.multinode.driver") -> dict:
        """Run tests/multinode/driver.py (or `module`) on the head host with `spec`; its JSON result."""
        cmd = self.head.cmd(sys.executable, "-m", module, json.dumps(spec))
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=self.driver_env(),
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"the driver ran past {timeout} s; its stderr:\n{err[-6000:]}") from None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        self.last_stderr = err  # what the driver logged (a test shows it when a check fails)
        results = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not results:
            raise AssertionError(f"the driver failed (exit {proc.returncode}); its stderr:\n{err[-6000:]}")
        return json.loads(results[-1][len("RESULT ") :])


def _start_ray(host: NetnsHost, *args: str, num_cpus: int = 2) -> None:
    cmd = host.cmd(
        _RAY,
        "start",
        f"--node-ip-address={host.ip}",
        f"--num-cpus={num_cpus}",
        "--disable-usage-stats",
        f"--temp-dir={os.path.join(host.temp_dir, 'ray')}",
        *args,
    )
    # The node's processes (its workers) inherit this environment: nothing
    # of the test process's that would steer Ray or gloo.
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "GLOO_SOCKET_IFNAME")}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, start_new_session=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")


@contextmanager
def sigterm_unwinds():
    """Inside: SIGTERM (timeout's, a CI runner's) raises SystemExit, so the
    `finally` blocks run and tear down what they started, instead of the
    process dying with its namespaces and Ray nodes left behind. Only where
    SIGTERM has no handler yet, and only on the main thread (Python's rule)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def two_hosts(system_config: dict | None = None, head_cpus: int = 2, pinned: tuple[str, str] | None = None):
    """Two namespace hosts on 10.99.0.0/24, a Ray head (`head_cpus` CPUs) on
    the first and a Ray worker node (2 CPUs) on the second; all torn down on
    exit, SIGTERM included. `pinned`: the CPUs of the head and of the worker
    (taskset lists, "0" and "1"): every process a host starts (its Ray node,
    its actors, the driver on the head) runs on its own, as on two machines,
    instead of both hosts sharing this machine's cores."""
    with sigterm_unwinds():
        yield from _two_hosts(system_config, head_cpus, pinned or (None, None))


def _two_hosts(system_config: dict | None, head_cpus: int, pinned: tuple[str | None, str | None]):
    remove_stale_netns()
    tag = f"{NETNS_PREFIX}{os.getpid()}_{next(_cluster_numbers) % 100}"
    head = NetnsHost(tag + "h", HEAD_IP, _host_temp_dir(tag + "h"), pinned[0])
    worker = NetnsHost(tag + "w", WORKER_IP, _host_temp_dir(tag + "w"), pinned[1])
    try:
        for host in (head, worker):
            _ip("netns", "add", host.name)
            _ip("-n", host.name, "link", "set", "lo", "up")
        _ip("link", "del", head.name, check=False)  # a leftover of a run killed mid-setup
        _ip("link", "add", head.name, "type", "veth", "peer", "name", worker.name)
        for host in (head, worker):
            _ip("link", "set", host.name, "netns", host.name)
            _ip("-n", host.name, "addr", "add", f"{host.ip}/24", "dev", host.name)
            _ip("-n", host.name, "link", "set", host.name, "up")
        # The head's second network: a veth pair with both ends on the head
        # (no dummy devices in every kernel), carrying the default route.
        other, other_peer = head.name[:-1] + "x", head.name[:-1] + "y"
        _ip("link", "del", other, check=False)
        _ip("link", "add", other, "type", "veth", "peer", "name", other_peer)
        for name in (other, other_peer):
            _ip("link", "set", name, "netns", head.name)
            _ip("-n", head.name, "link", "set", name, "up")
        _ip("-n", head.name, "addr", "add", f"{OTHER_HEAD_IP}/24", "dev", other)
        _ip("-n", head.name, "route", "add", "default", "via", "10.98.0.254", "dev", other, "onlink")

        head_args = ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"]
        if system_config:
            head_args.append(f"--system-config={json.dumps(system_config)}")
        _start_ray(head, *head_args, num_cpus=head_cpus)
        address = f"{HEAD_IP}:{RAY_PORT}"
        _start_ray(worker, f"--address={address}")
        yield TwoHosts(head, worker, address)
    finally:
        for host in (worker, head):
            remove_netns(host.name)  # its temp dir too

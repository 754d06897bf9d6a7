"""Exposure: the local Ray that `rlrepro train` starts listens on loopback only, with no dashboard and no usage
statistics, and prints no token-authentication warning. The test starts Ray the way `rlrepro train` does
(rlrepro.orchestration.ray_start.start_ray), in a child process (so the environment it sets cannot
leak into other tests), creates an actor, and lists the listening TCP sockets of every process of that Ray
(from /proc/net/tcp{,6} and /proc/<pid>/fd: no psutil needed).

The second test is a whole `rlrepro train` with the listeners rlrepro makes itself (a CPU data-parallel trainer's
gloo group, the collective weight sync's TCPStore and gloo group), run where the hostname resolves to the
machine's outward address, as on many cloud machines: a private /etc/hosts bind-mounted in a mount namespace of
the run's own (`unshare -m`; nothing outside it changes). Every listening socket of every process of the run must
be on loopback (issue 22, item 2: gloo's default device followed the hostname).

The third is a two-node Ray cluster on loopback (issue 28): both nodes and a driver joining them."""
import json
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap

import pytest

pytestmark = pytest.mark.slow

CHILD = textwrap.dedent("""
    import json, os, sys
    from rlrepro.orchestration.ray_start import start_ray

    start_ray(None, 1)
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def pid(self):
            return os.getpid()

    probe = Probe.remote()
    ray.get(probe.pid.remote())
    from ray._common.usage import usage_lib

    info = {"node_ip": ray.nodes()[0]["NodeManagerAddress"], "usage_stats": usage_lib.usage_stats_enabled()}
    print("READY " + json.dumps(info), flush=True)
    sys.stdin.readline()  # the parent inspects the sockets, then lets us go
    ray.shutdown()
""")


def _addr(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(hex_addr, 16)))
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def listening_sockets() -> dict[str, tuple[str, int]]:
    """socket inode -> (address, port) of every TCP socket in LISTEN state."""
    out = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(name).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A":  # LISTEN
                addr, port = f[1].split(":")
                out[f[9]] = (_addr(addr), int(port, 16))
    return out


def session_pids(sid: int) -> list[int]:
    pids = []
    for entry in __import__("os").listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:
                pids.append(int(entry))
    return pids


def socket_inodes(pid: int) -> set[str]:
    import os

    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def sample_listeners(sessions, found: dict) -> dict:
    """Add to ``found`` every listening socket of the processes of ``sessions`` (session ids), as
    (pid, address, port) -> the first 100 characters of its command line; returns ``found``."""
    listeners = listening_sockets()
    for sid in sessions:
        for pid in session_pids(sid):
            try:
                name = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:100]
            except OSError:
                continue
            for inode in socket_inodes(pid):
                if inode in listeners:
                    found.setdefault((pid, *listeners[inode]), name)
    return found


def release(child, message: str = "\n") -> None:
    """Tell a child waiting on stdin to end (``message``), kill it if it does not, then every process of its
    session (Ray's agents can outlive a driver)."""
    try:
        child.stdin.write(message)
        child.stdin.flush()
        child.wait(timeout=60)
    except Exception:  # noqa: BLE001
        child.kill()
    kill_session(child.pid)


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (what outlives its parent: Ray's agents, a raylet's workers)."""
    import os

    for pid in session_pids(sid):
        try:
            os.kill(pid, 9)
        except OSError:
            pass


def read_ready(child, err, what: str) -> dict:
    """Wait for the child's ``READY {json}`` line and return the JSON; the child's stderr if it ends first."""
    line = ""
    while not line.startswith("READY"):
        line = child.stdout.readline()
        if not line:
            err.seek(0)
            raise AssertionError(f"the child exited before {what}: {err.read()[-3000:]}")
    return json.loads(line.split(" ", 1)[1])


def test_local_ray_listens_on_loopback_only_without_dashboard_or_usage_stats():
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # as a user's shell would have it
    err = tempfile.TemporaryFile(mode="w+")
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=err, text=True, env=env, start_new_session=True)
    try:
        info = read_ready(child, err, "Ray was up")
        listeners = listening_sockets()
        found, commands = [], []
        for pid in session_pids(child.pid):
            try:
                cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
            except OSError:
                continue
            commands.append(cmd)
            for inode in socket_inodes(pid):
                if inode in listeners:
                    found.append((pid, cmd[:100], *listeners[inode]))
        assert len({pid for pid, *_ in found}) >= 3, found  # driver, gcs, raylet, agents, workers...
        exposed = [f for f in found if f[2] not in LOOPBACK]
        assert not exposed, f"Ray processes listening beyond loopback: {exposed}"
        assert info["node_ip"] == "127.0.0.1"  # what actor error messages report as ip=
        assert info["usage_stats"] is False
        # include_dashboard=False: Ray still runs its head process, for its usage-stats module only (itself off),
        # without the web frontend, on loopback
        heads = [cmd for cmd in commands if "dashboard/dashboard.py" in cmd]
        assert all("--disable-frontend" in cmd and "--modules-to-load=UsageStatsHead " in cmd + " " for cmd in heads)
        err.seek(0)
        assert "Token authentication is enabled for this Ray cluster" not in err.read()  # RAY_AUTH_MODE=token is set
    finally:
        release(child)
        err.close()


def outward_ipv4() -> str | None:
    """An IPv4 address of one of this machine's interfaces other than loopback (one a socket can bind)."""
    import fcntl

    for _, name in socket.if_nameindex():
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
        except OSError:
            continue
        finally:
            s.close()
        addr = socket.inet_ntoa(raw[20:24])
        if not addr.startswith("127."):
            return addr
    return None


def hostname_mapped_outward(tmp_path) -> list[str] | None:
    """The command prefix that runs a shell command with this machine's hostname resolving to its outward address
    (a private hosts file bind-mounted over /etc/hosts in a new mount namespace), or None where that cannot be
    done here (not root, no unshare, no outward interface)."""
    import shutil

    addr = outward_ipv4()
    if addr is None or shutil.which("unshare") is None:
        return None
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")
    prefix = ["unshare", "-m", "sh", "-c", f"mount --bind {hosts} /etc/hosts && exec \"$@\"", "sh"]
    probe = [sys.executable, "-c", "import socket; print(socket.gethostbyname(socket.gethostname()))"]
    try:
        out = subprocess.run(prefix + probe, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return prefix if out.returncode == 0 and out.stdout.strip() == addr else None


def test_a_run_with_its_own_listeners_listens_on_loopback_only_where_the_hostname_is_outward(tmp_path):
    import os
    import time

    prefix = hostname_mapped_outward(tmp_path)
    if prefix is None:
        pytest.skip("cannot map the hostname to an outward address here (needs root, unshare -m and an interface "
                    "other than loopback)")
    run = tmp_path / "run"
    cmd = ["rlrepro", "train", "recipe=grpo_tiny", f"run.dir={run}", "train.num_gpus=2", "rollout.num_workers=2",
           "rollout.weight_sync=collective", "train.steps=3", "logger.progress=false", "rollout.prompts_per_step=2"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "GLOO_", "NCCL_"))}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    err = tempfile.TemporaryFile(mode="w+")
    child = subprocess.Popen(prefix + cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, env=env,
                             start_new_session=True, cwd=tmp_path)
    found: dict[tuple[int, str, int], str] = {}
    try:
        while child.poll() is None:  # the groups live from set-up to the end: sample them all the while
            sample_listeners([child.pid], found)
            time.sleep(0.2)
        err.seek(0)
        assert child.returncode == 0, err.read()[-3000:]
    finally:
        if child.poll() is None:
            child.kill()
        kill_session(child.pid)
        err.close()
    actors = {pid for (pid, *_), name in found.items() if "TrainerWorker" in name or "RolloutWorker" in name}
    assert len(actors) >= 3, found  # two trainer ranks and rollout workers were seen listening
    exposed = {k: v for k, v in found.items() if k[1] not in LOOPBACK}
    assert not exposed, f"listening beyond loopback with the hostname resolving outward: {exposed}"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


JOIN_CHILD = textwrap.dedent("""
    import json, os, sys
    from rlrepro.orchestration.ray_start import start_ray

    start_ray(sys.argv[1], None)  # as `rlrepro train ray.address=127.0.0.1:PORT` joins
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def where(self):
            return os.getpid(), ray.get_runtime_context().get_node_id()

    probes = [Probe.options(resources={name: 0.001}).remote() for name in ("trainer_node", "rollout_node")]
    where = ray.get([p.where.remote() for p in probes])
    print("READY " + json.dumps({"nodes": len({n for _, n in where}), "driver_ip": ray.util.get_node_ip_address()}),
          flush=True)
    sys.stdin.readline()
""")


def test_a_two_node_loopback_cluster_and_its_driver_listen_on_loopback_only():
    """Issue 28: the second node too. tests/test_cluster.py's two-node cluster (a head and a second node on
    127.0.0.1, Ray's cluster_utils, no dashboard, no usage statistics), a driver joining it as `rlrepro train
    ray.address=...` does (start_ray) with an actor on each node: every listening socket of both nodes' processes
    and of the driver is on loopback. (tests/test_cluster.py also samples them through whole runs.)"""
    from test_cluster import LoopbackCluster, clean_env

    cluster = LoopbackCluster()
    err = tempfile.TemporaryFile(mode="w+")
    child = subprocess.Popen([sys.executable, "-c", JOIN_CHILD, cluster.address], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=err, text=True, env=clean_env(), start_new_session=True)
    try:
        assert read_ready(child, err, "its actors were up") == {"nodes": 2, "driver_ip": "127.0.0.1"}
        found = [(pid, cmd, host, port) for (pid, host, port), cmd in
                 sample_listeners([cluster.proc.pid, child.pid], {}).items()]
        assert len({pid for pid, cmd, *_ in found if "raylet" in cmd}) == 2, found  # both nodes seen listening
        assert len({pid for pid, cmd, *_ in found if "gcs_server" in cmd}) == 1, found
        exposed = [f for f in found if f[2] not in LOOPBACK]
        assert not exposed, f"listening beyond loopback on a two-node loopback cluster: {exposed}"
        assert not [cmd for pid in session_pids(cluster.proc.pid)
                    for cmd in [open(f"/proc/{pid}/cmdline").read()] if "dashboard/dashboard.py" in cmd and
                    "--disable-frontend" not in cmd]  # no dashboard frontend
    finally:
        release(child)
        err.close()
        cluster.close()

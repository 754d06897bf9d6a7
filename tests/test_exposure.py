"""Exposure: the local Ray that `rlrepro train` starts listens on loopback only, with no dashboard and no usage
statistics, and prints no token-authentication warning. The test starts Ray the way `rlrepro train` does
(rlrepro.orchestration.ray_start.start_ray), in a child process (so the environment it sets cannot
leak into other tests), creates an actor, and lists the listening TCP sockets of every process of that Ray
(from /proc/net/tcp{,6} and /proc/<pid>/fd: no psutil needed)."""
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


def test_local_ray_listens_on_loopback_only_without_dashboard_or_usage_stats():
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # as a user's shell would have it
    err = tempfile.TemporaryFile(mode="w+")
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=err, text=True, env=env, start_new_session=True)
    try:
        line = ""
        while not line.startswith("READY"):
            line = child.stdout.readline()
            if not line:
                err.seek(0)
                raise AssertionError(f"the child exited before Ray was up: {err.read()[-3000:]}")
        info = json.loads(line.split(" ", 1)[1])
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
        try:
            child.stdin.write("\n")
            child.stdin.flush()
            child.wait(timeout=60)
        except Exception:  # noqa: BLE001
            child.kill()
        for pid in session_pids(child.pid):  # Ray's agents can outlive a driver
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        err.close()

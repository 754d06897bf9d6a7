"""start_ray (issue 21 item 1, issue 20): local mode starts a Ray instance of its own even when the machine has a
cluster (a `ray start` address file, RAY_ADDRESS), only a given ray.address joins one, the node address stays
127.0.0.1 (also for a ray imported before start_ray), and no token-authentication warning is printed.

The cluster is a `ray start --head` on 127.0.0.1 with its own --temp-dir (its address file lies there; the
children that should find it get RAY_TMPDIR) and its own token file. It is stopped by ending exactly its
processes: those of the session `ray start` ran in, and any whose command line names its temp dir. Never
`ray stop`, which ends every Ray on the machine, other people's included.
"""
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from rlrepro.orchestration.ray_start import LOCAL_ONLY_ENV, is_local, is_loopback_address

TOKEN_WARNING = "Token authentication is enabled for this Ray cluster"

CHILD = textwrap.dedent("""
    import json, sys
    if sys.argv[2] == "import-ray-first":
        import ray
    from rlrepro.orchestration.ray_start import start_ray

    start_ray(json.loads(sys.argv[1]), 1)
    import ray

    @ray.remote(num_cpus=0)
    def one():
        return 1

    assert ray.get(one.remote()) == 1
    print("RESULT " + json.dumps({"gcs": ray.get_runtime_context().gcs_address, "nodes": len(ray.nodes()),
                                  "node_ip": ray.util.get_node_ip_address(), "cpus": ray.cluster_resources()["CPU"]}))
    ray.shutdown()
""")


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # as a user's shell would have it
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes(sid: int, marker: str | None) -> list[int]:
    """Pids in session ``sid`` or whose command line contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            cmd = open(f"/proc/{entry}/cmdline").read()
        except OSError:
            continue
        if int(fields[3]) == sid or (marker and marker in cmd):
            found.append(int(entry))
    return found


def end_processes(sid: int, marker: str | None = None) -> None:
    for _ in range(20):
        pids = processes(sid, marker)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.2)


def run_child(address, env: dict, mode: str = "plain") -> tuple[dict | None, str]:
    """CHILD in its own session; returns (its RESULT, its stderr); ends whatever Ray it left behind."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(address), mode], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = child.communicate(timeout=180)
    finally:
        end_processes(child.pid)  # Ray's agents can outlive a driver (they keep its session)
    results = [line for line in out.splitlines() if line.startswith("RESULT ")]
    return (json.loads(results[0].split(" ", 1)[1]) if results else None), err


@pytest.fixture(scope="module")
def loopback_cluster():
    """A one-CPU cluster on 127.0.0.1 left by `ray start`, with token authentication on its own token file."""
    tmp = tempfile.mkdtemp(prefix="rlrray", dir="/tmp")  # short: Ray's socket paths live under it
    token = os.path.join(tmp, "token")
    with open(token, "w") as f:
        f.write(secrets.token_hex(32))
    auth = dict(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token)
    env = clean_env(**LOCAL_ONLY_ENV, **auth)
    port = free_port()
    start = subprocess.Popen([sys.executable, "-c", "from ray.scripts.scripts import main; main()", "start",
                              "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                              "--include-dashboard=false", "--dashboard-agent-listen-port=0",
                              f"--temp-dir={tmp}/ray"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=env, start_new_session=True)
    try:
        log, _ = start.communicate(timeout=240)
        assert start.returncode == 0, log
        with open(os.path.join(tmp, "ray", "ray_current_cluster")) as f:
            address = f.read().strip()
        assert address == f"127.0.0.1:{port}"
        yield dict(address=address, tmp=tmp, auth=auth)
    finally:
        end_processes(start.pid, tmp)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
def test_local_mode_starts_its_own_ray_beside_a_cluster_found_on_the_machine(loopback_cluster):
    c = loopback_cluster
    env = clean_env(RAY_TMPDIR=c["tmp"], RAY_AUTH_TOKEN_PATH=c["auth"]["RAY_AUTH_TOKEN_PATH"])
    # the premise: a plain ray.init() in this environment would join that cluster (and refuse num_cpus)
    probe = subprocess.run([sys.executable, "-c", "from ray._private.services import get_ray_address_from_environment"
                            " as found; print(found(None, None))"], capture_output=True, text=True, env=env,
                           timeout=120)
    assert probe.stdout.strip().splitlines()[-1] == c["address"], probe.stderr
    result, err = run_child(None, env)
    assert result is not None, err
    assert result["gcs"] != c["address"] and result["nodes"] == 1 and result["cpus"] == 1
    assert result["node_ip"] == "127.0.0.1"
    assert TOKEN_WARNING not in err, err  # RAY_AUTH_MODE=token is set: the same authentication, said by no one


@pytest.mark.slow
def test_local_mode_ignores_ray_address(loopback_cluster):
    c = loopback_cluster
    env = clean_env(RAY_ADDRESS=c["address"], RAY_AUTH_TOKEN_PATH=c["auth"]["RAY_AUTH_TOKEN_PATH"])
    result, err = run_child(None, env)
    assert result is not None, err
    assert result["gcs"] != c["address"] and result["node_ip"] == "127.0.0.1"
    assert f"RAY_ADDRESS={c['address']} is set but ray.address is not" in err


@pytest.mark.slow
def test_a_given_loopback_address_joins_that_cluster(loopback_cluster):
    c = loopback_cluster
    result, err = run_child(c["address"], clean_env(**c["auth"]))
    assert result is not None, err
    assert result["gcs"] == c["address"] and result["cpus"] == 1  # the cluster's one CPU, not start_ray's
    assert result["node_ip"] == "127.0.0.1"  # not turned into the machine's outward address


@pytest.mark.slow
def test_a_ray_imported_before_start_ray_still_stays_on_loopback():
    """Pins the fallback for a process that imported ray before start_ray could set the environment: the
    constant exists and still decides the node address (start_ray raises if the address is not 127.0.0.1)."""
    result, err = run_child(None, clean_env(), mode="import-ray-first")
    assert result is not None, err
    assert result["node_ip"] == "127.0.0.1"


PIN = textwrap.dedent("""
    import os, sys
    if sys.argv[1] == "env":
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants, services
    if sys.argv[1] == "attribute":
        ray_constants.ENABLE_RAY_CLUSTER = False
    print(ray_constants.ENABLE_RAY_CLUSTER, services.resolve_ip_for_localhost("127.0.0.1"))
""")


@pytest.mark.parametrize("how", ["env", "attribute"])
def test_ray_keeps_127_0_0_1_when_told_either_way(how):
    """What start_ray relies on, without starting Ray: the variable read at import, or the constant set after it,
    keeps Ray from turning 127.0.0.1 into the machine's outward address."""
    out = subprocess.run([sys.executable, "-c", PIN, how], capture_output=True, text=True, env=clean_env(),
                         timeout=120)
    assert out.stdout.split() == ["False", "127.0.0.1"], out.stderr


def test_which_addresses_are_local_or_loopback():
    assert is_local(None) and is_local("") and is_local("  ") and is_local("local")
    assert not is_local("auto") and not is_local("10.0.0.1:6379")
    assert is_loopback_address("127.0.0.1:6379") and is_loopback_address("localhost:1")
    assert is_loopback_address("[::1]:6379") and is_loopback_address("127.0.0.2:6379")
    assert not is_loopback_address("10.0.0.1:6379") and not is_loopback_address("auto")
    assert not is_loopback_address("ray://127.0.0.1:10001") and not is_loopback_address("head-node:6379")


def test_a_failed_join_says_why(monkeypatch):
    """The two causes seen when joining a `ray start` cluster (issue 28): token authentication the driver lacks,
    and a loopback address whose nodes took the machine's outward address (no RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0)."""
    from rlrepro.orchestration import ray_start

    error = ConnectionError("Failed to connect to Ray cluster at 127.0.0.1:6379")
    monkeypatch.setattr(ray_start, "_cluster_nodes", lambda address: (None, "AuthenticationError: token missing"))
    assert "RAY_AUTH_MODE=token" in ray_start.join_failure_hint("127.0.0.1:6379", error, True)
    monkeypatch.setattr(ray_start, "_cluster_nodes", lambda address: (["192.0.2.2"], None))
    hint = ray_start.join_failure_hint("127.0.0.1:6379", error, True)
    assert "took the address(es) 192.0.2.2" in hint and "ray.address=192.0.2.2:6379" in hint
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in hint
    monkeypatch.setattr(ray_start, "_cluster_nodes", lambda address: (None, "no answer"))
    assert "did not answer" in ray_start.join_failure_hint("10.1.2.3:6379", error, False)

"""Where rlrepro's own process groups listen (rlrepro.orchestration.network; issue 22, item 2): on the node's
address, loopback in local mode, whatever the hostname resolves to; on a cluster on the configured interface.
Fast: no Ray. tests/test_exposure.py checks a whole run."""
import subprocess
import sys
import textwrap

import pytest

from rlrepro.orchestration import network
from test_exposure import LOOPBACK, hostname_mapped_outward, listening_sockets, socket_inodes


@pytest.fixture
def clean_env(monkeypatch):
    """No interface variables during the test, and exactly the ones from before it afterwards: pin_socket_interfaces
    sets them in os.environ itself, which monkeypatch alone would not undo (a GLOO_SOCKET_IFNAME=eth7 left behind
    broke every later gloo group of the session)."""
    import os

    names = (*network.SOCKET_IFNAME_ENVS, network.NETWORK_INTERFACE_ENV)
    saved = {name: os.environ.get(name) for name in names}
    for var in names:
        monkeypatch.delenv(var, raising=False)
    yield monkeypatch
    monkeypatch.undo()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def test_local_mode_pins_both_libraries_to_loopback_whatever_was_set(clean_env, capsys):
    lo = network.interface_of("127.0.0.1")
    assert lo is not None
    clean_env.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert network.pin_socket_interfaces("127.0.0.1") == lo
    assert {v: __import__("os").environ[v] for v in network.SOCKET_IFNAME_ENVS} == dict.fromkeys(
        network.SOCKET_IFNAME_ENVS, lo)
    assert "GLOO_SOCKET_IFNAME=eth0 replaced by" in capsys.readouterr().err


def test_on_a_cluster_the_configured_interface_wins_then_the_users_then_the_node_addresses(clean_env, capsys):
    import os

    assert network.socket_interface("10.1.2.3", configured="ib0") == "ib0"
    clean_env.setenv(network.NETWORK_INTERFACE_ENV, "eth7")
    assert network.socket_interface("10.1.2.3") == "eth7"
    assert network.pin_socket_interfaces("10.1.2.3") == "eth7" and os.environ["NCCL_SOCKET_IFNAME"] == "eth7"
    clean_env.delenv(network.NETWORK_INTERFACE_ENV)
    clean_env.delenv("GLOO_SOCKET_IFNAME")
    clean_env.setenv("NCCL_SOCKET_IFNAME", "bond0")
    assert network.pin_socket_interfaces("203.0.113.9") is None  # no interface here has that address
    assert os.environ["NCCL_SOCKET_IFNAME"] == "bond0" and "GLOO_SOCKET_IFNAME" not in os.environ
    assert "no interface of this machine carries the node address 203.0.113.9" in capsys.readouterr().err


CHILD = textwrap.dedent("""
    import datetime, os, sys, threading
    import torch, torch.distributed as dist
    from rlrepro.orchestration.network import pin_socket_interfaces
    from rlrepro.orchestration.weight_sync import Rendezvous, WeightBroadcaster

    timeout = datetime.timedelta(seconds=60)
    rdv = Rendezvous("127.0.0.1")
    members = {}

    def join(rank):  # the collective weight sync's group (an explicit gloo device)
        members[rank] = WeightBroadcaster(rdv.host, rdv.port, rank, 2, rendezvous=rdv if rank == 0 else None)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    t = torch.ones(3)
    threading.Thread(target=members[1]._broadcast, args=(torch.zeros(3),)).start()
    members[0]._broadcast(t)
    # a group made as init_process_group makes it (device from GLOO_SOCKET_IFNAME), once the interfaces are pinned
    pin_socket_interfaces("127.0.0.1")
    rdv2 = Rendezvous("127.0.0.1")
    stores = [rdv2.store(2, timeout), dist.TCPStore("127.0.0.1", rdv2.port, 2, False, timeout)]
    groups = {}
    def make(rank):
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("dp", stores[rank]), rank, 2, timeout)
    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print("READY", flush=True)
    sys.stdin.readline()
""")


def test_process_groups_listen_on_loopback_where_the_hostname_resolves_outward(tmp_path):
    prefix = hostname_mapped_outward(tmp_path)
    if prefix is None:
        pytest.skip("cannot map the hostname to an outward address here (needs root, unshare -m and an interface "
                    "other than loopback)")
    child = subprocess.Popen(prefix + [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.startswith("READY"), child.stderr.read()[-3000:] if child.poll() is not None else line
        # the child is exec'd by sh: the python process is the direct child's descendant with the sockets
        pids = [int(p) for p in subprocess.run(["pgrep", "-P", str(child.pid)], capture_output=True,
                                               text=True).stdout.split()] + [child.pid]
        listeners = listening_sockets()
        found = [listeners[i] for pid in pids for i in socket_inodes(pid) if i in listeners]
        assert len(found) >= 4, found  # two stores, and gloo's listeners of the two groups
        assert all(addr in LOOPBACK for addr, _ in found), found
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(timeout=60)


def test_actor_environment_pins_the_hash_seed_on_a_cluster(monkeypatch):
    """A cluster's workers start from `ray start`'s environment: the driver's pinned PYTHONHASHSEED travels in the
    actors' runtime_env (an episode's reward runs there), with ray.network_interface; a local run's actors inherit
    the driver's environment and get none."""
    from rlrepro.cli import compose_config
    from rlrepro.orchestration.actors import actor_env_vars
    from rlrepro.orchestration.config import to_schema

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    local = to_schema(compose_config(["recipe=grpo_tiny"]))
    assert actor_env_vars(local) == {}
    cluster = to_schema(compose_config(["recipe=grpo_tiny", "ray.address=10.0.0.5:6379",
                                        "ray.network_interface=eth1"]))
    assert actor_env_vars(cluster) == {"PYTHONHASHSEED": "0", network.NETWORK_INTERFACE_ENV: "eth1"}

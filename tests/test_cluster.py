"""Two Ray nodes on one machine, on loopback: `rlrepro train recipe=grpo_tiny ray.address=127.0.0.1:PORT` with the
trainer ranks on one node and the rollout workers on the other (docs/CLUSTER.md).

The cluster is Ray's own ``ray.cluster_utils.Cluster`` in a child process of its own session (a head with the
custom resource ``trainer_node``, a second node with ``rollout_node``, both ``--node-ip-address=127.0.0.1`` with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, no dashboard, no usage statistics). ``ray start --address`` cannot add a
second node on loopback: with that variable it refuses to start a worker node, without it 127.0.0.1 becomes the
machine's outward address. The child takes commands on stdin: ``kill`` removes the second node (its raylet and
every process of it, SIGKILL), ``add`` starts it again.

1. The run on the two nodes (``ray.placement=split``, two data-parallel trainer ranks, two rollout workers, the
   collective weight sync: a TCPStore on the trainer's node that the other node's workers join) is bitwise
   identical to the same run in local mode (``rlrepro diff --strict`` exit 0); inputs.json says where each actor
   ran; every listening socket of both nodes and of the driver, sampled all the while, is on loopback.
2. The second node killed mid-run (after step 2's checkpoint): the run stops (exit 1) naming the node and the
   rollout workers it held and the checkpoint left; once the node is back, ``run.resume=true`` continues from that
   checkpoint and ends identical.
"""
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from test_exposure import LOOPBACK, kill_session, release, sample_listeners

pytestmark = pytest.mark.slow

BASE = ["recipe=grpo_tiny", "train.steps=4", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_tokens=6", "warm_start.steps=10", "warm_start.target=answer", "reward.fn=prefix_match",
        "checkpoint.every=2", "logger.progress=false", "train.micro_batch_size=8", "train.warmup_steps=1",
        "train.num_gpus=2", "rollout.num_workers=2"]
ON_TWO_NODES = ["ray.placement=split", "ray.trainer_node=trainer_node", "ray.rollout_node=rollout_node",
                "ray.num_nodes=2", "rollout.weight_sync=collective"]

CLUSTER = textwrap.dedent("""
    import os, sys
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray is imported: nodes stay on 127.0.0.1
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    from ray.cluster_utils import Cluster

    # a node that is gone is seen within ~2 s (Ray's defaults: tens of seconds)
    fast = {"health_check_period_ms": 500, "health_check_timeout_ms": 500, "health_check_failure_threshold": 3,
            "health_check_initial_delay_ms": 0}
    common = dict(node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False,
                  object_store_memory=100 * 1024 * 1024)
    cluster = Cluster(initialize_head=True, head_node_args=dict(common, resources={"trainer_node": 1},
                                                                _system_config=fast))
    add = lambda: cluster.add_node(**common, resources={"rollout_node": 1})
    second = add()
    print("READY", cluster.address, flush=True)
    for line in sys.stdin:
        if line.strip() == "kill":
            cluster.remove_node(second, allow_graceful=False)
            print("KILLED", flush=True)
        elif line.strip() == "add":
            second = add()
            print("ADDED", flush=True)
        else:
            break
    cluster.shutdown()
""")


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "GLOO_", "NCCL_", "RLREPRO_"))}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline", RAY_USAGE_STATS_ENABLED="0", **extra)
    return env


class LoopbackCluster:
    """The two-node cluster child (see the module docstring)."""

    def __init__(self) -> None:
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-c", CLUSTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, env=clean_env(), start_new_session=True)
        self.address = self._expect("READY").split()[1]

    def _expect(self, word: str) -> str:
        line = ""
        while not line.startswith(word):
            line = self.proc.stdout.readline()
            if not line:
                self.err.seek(0)
                raise AssertionError(f"the cluster child ended before {word}: {self.err.read()[-3000:]}")
        return line

    def command(self, cmd: str, answer: str) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        self._expect(answer)

    def close(self) -> None:
        release(self.proc, "quit\n")
        self.err.close()


@pytest.fixture(scope="module")
def cluster():
    c = LoopbackCluster()
    yield c
    c.close()


def train(run_dir: Path, *extra: str, env: dict | None = None, watch=None) -> tuple[int, str]:
    """``rlrepro train`` as a user runs it, in a session of its own; ``watch(proc)`` is called every 0.2 s while
    it runs. Returns (exit code, stderr)."""
    err = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(["rlrepro", "train", *BASE, f"run.dir={run_dir}", *extra], stdout=subprocess.DEVNULL,
                            stderr=err, text=True, env=env or clean_env(), start_new_session=True,
                            cwd=run_dir.parent)
    try:
        while proc.poll() is None:
            if watch is not None:
                watch(proc)
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        kill_session(proc.pid)
    err.seek(0)
    text = err.read()
    err.close()
    return proc.returncode, text


def diff(a: Path, b: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["rlrepro", "diff", str(a), str(b), "--strict"], capture_output=True, text=True,
                          env=clean_env(), timeout=120)


def steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    run = tmp_path_factory.mktemp("local") / "run"
    rc, err = train(run)
    assert rc == 0, err[-3000:]
    assert steps(run) == [1, 2, 3, 4]
    return run


def test_two_nodes_trainer_on_one_engines_on_the_other_bitwise_identical_and_on_loopback(cluster, ref, tmp_path):
    run = tmp_path / "run"
    found: dict[tuple[int, str, int], str] = {}

    def sample(proc) -> None:  # every listener of both nodes (the cluster's session) and of the driver
        sample_listeners([cluster.proc.pid, proc.pid], found)

    rc, err = train(run, f"ray.address={cluster.address}", *ON_TWO_NODES, watch=sample)
    assert rc == 0, err[-3000:]
    result = diff(ref, run)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "cluster differs" in result.stdout and "informational" in result.stdout  # 1 node vs 2, never the verdict
    nodes = json.loads((run / "inputs.json").read_text())["cluster"]
    assert nodes["num_nodes"] == 2 and nodes["placement"] == "split"
    where = {tuple(n["resources"]): n["actors"] for n in nodes["nodes"]}
    assert where == {("trainer_node",): ["trainer rank 0", "trainer rank 1"],
                     ("rollout_node",): ["rollout worker 0", "rollout worker 1"]}, nodes
    raylets = {pid for (pid, *_), name in found.items() if "raylet" in name}
    actors = {pid for (pid, *_), name in found.items() if "TrainerWorker" in name or "RolloutWorker" in name}
    assert len(raylets) == 2 and len(actors) >= 3, found  # both nodes, the trainer ranks and workers seen listening
    exposed = {k: v for k, v in found.items() if k[1] not in LOOPBACK}
    assert not exposed, f"listening beyond loopback on a two-node loopback cluster: {exposed}"


def test_second_node_killed_mid_run_is_named_and_the_run_resumes_identically(cluster, ref, tmp_path):
    run = tmp_path / "run"
    killed = []

    def kill_after_step_2(proc) -> None:  # once step 2's checkpoint is complete (checkpoint.every=2)
        if not killed and (run / "checkpoints" / "step_000002").is_dir():
            cluster.command("kill", "KILLED")
            killed.append(steps(run))

    # seeded wall-clock delays before each step's update (0-3 s; steps 3-4: 2.7, 2.0 s with seed 0): the run is
    # still going when the node dies (RLREPRO_TEST_DELAYS is informational, it changes no bit)
    env = clean_env(RLREPRO_TEST_DELAYS="0:3")
    rc, err = train(run, f"ray.address={cluster.address}", *ON_TWO_NODES, env=env, watch=kill_after_step_2)
    try:
        assert killed, f"the run ended before the node was killed: {err[-2000:]}"
        assert rc == 1, err[-3000:]
        assert "NodeLost" in err and "left the cluster" in err, err[-3000:]
        assert "held rollout worker 0, rollout worker 1" in err, err[-3000:]  # which actors were lost
        assert "step_000002" in err and "run.resume=true" in err, err[-3000:]
        assert 2 <= steps(run)[-1] < 4, steps(run)
    finally:
        cluster.command("add", "ADDED")
    rc, err = train(run, f"ray.address={cluster.address}", *ON_TWO_NODES, "run.resume=true", env=env)
    assert rc == 0, err[-3000:]
    assert steps(run) == [1, 2, 3, 4]
    result = diff(ref, run)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]

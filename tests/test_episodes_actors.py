"""ActorGroup.run_episodes through Ray (local mode, CPU): episodes dealt to two rollout workers give the results
of one in-process runner, and a worker killed before its part is replaced and re-runs its episodes from their
keys with the same results."""
import sys
import textwrap

import pytest
import torch

from rlrepro.cli import compose_config
from rlrepro.data import load_reward_fn
from rlrepro.envs import EnvConfig, episode_seed, load_env, make_calculator_records
from rlrepro.model import load_pretrained, load_tokenizer, write_tiny_checkpoint
from rlrepro.orchestration.config import validate
from rlrepro.orchestration.episodes import EpisodeRequest, run_episodes
from rlrepro.rollout import Engine, SamplingParams, request_seed

ENV_MODULE = textwrap.dedent('''
    from rlrepro.envs import EnvReset, Environment, StepResult

    class Scripted(Environment):
        def __init__(self, record, seed):
            self.record, self.seed, self.n = record, seed, 0

        def reset(self):
            return EnvReset(prompt=self.record.prompt)

        def step(self, text):
            self.n += 1
            if self.n >= 2:
                return StepResult(done=True, reward=float(len(text) % 3))
            return StepResult(messages=[{"role": "tool", "content": f"obs {self.seed % 89}"}])

    def scripted(record, seed, *, config, reward_fn):
        return Scripted(record, seed)
''')


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    """A factory module importable in this process and in Ray's workers (PYTHONPATH, inherited by them)."""
    (tmp_path / "rlrepro_test_actor_envs.py").write_text(ENV_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    yield "rlrepro_test_actor_envs:scripted"
    sys.modules.pop("rlrepro_test_actor_envs", None)


def test_actor_group_runs_episodes_and_replaces_a_dead_worker(tmp_path, env_module):
    from rlrepro.orchestration.actors import ActorGroup

    model_dir = write_tiny_checkpoint(tmp_path / "tiny", seed=3)
    tok = load_tokenizer(model_dir)
    cfg = validate(compose_config(["recipe=grpo_tiny", "rollout.num_workers=2", "ray.num_cpus=2",
                                   "rollout.max_restarts=2"]))
    env_config = EnvConfig(fn=env_module, max_turns=2)
    reqs = []
    for rec in make_calculator_records(3, seed=2):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": rec.prompt}]))
        for j in range(2):
            params = SamplingParams(max_tokens=6, seed=request_seed(0, 1, rec.uid, j),
                                    stop_token_ids=(tok.eos_token_id,))
            reqs.append(EpisodeRequest((rec.uid, j), rec, ids, params, episode_seed(0, 1, rec.uid, j)))
    torch.set_num_threads(1)
    want = run_episodes(Engine(load_pretrained(model_dir)), reqs,
                        load_env(env_config, load_reward_fn("exact_match")), tok, end_of_turn=tok.eos_token)
    assert all(r.num_turns == 2 for r in want)
    group = ActorGroup(cfg, str(model_dir))
    try:
        got = group.run_episodes(reqs[::-1], env_config, "exact_match")
        assert got == want
        group._ray.kill(group.workers[1], no_restart=True)
        again = group.run_episodes(reqs, env_config, "exact_match", tool_threads=1)
        assert again == want and group.restarts == 1
    finally:
        group.shutdown()

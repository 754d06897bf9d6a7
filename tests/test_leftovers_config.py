"""rollout.dynamic_sampling drops groups whose rewards are all equal; with train.advantage=reinforce_pp (batch
normalisation, no group baseline) such a group still has a nonzero advantage, so the combination is refused at
config-check time, naming both keys and the fix."""
import pytest
import torch

from rlrepro.checks import ConfigError
from rlrepro.orchestration.config import validate
from rlrepro.trainer import compute_advantages
from rlrepro.trainer.advantages import ADVANTAGE_MODES


def _cfg(advantage: str, dynamic: bool) -> dict:
    return {"model": {"init": "tiny"}, "rollout": {"dynamic_sampling": dynamic}, "train": {"advantage": advantage}}


def test_dynamic_sampling_with_reinforce_pp_is_refused_naming_both_keys_and_the_fix():
    with pytest.raises(ConfigError) as e:
        validate(_cfg("reinforce_pp", True))
    msg = str(e.value)
    assert "rollout.dynamic_sampling=true" in msg and "train.advantage=reinforce_pp" in msg
    assert "rollout.dynamic_sampling=false" in msg and "reinforce_pp_baseline" in msg and "grpo" in msg


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_dynamic_sampling_with_a_group_baseline_is_accepted(advantage):
    assert validate(_cfg(advantage, True)).rollout.dynamic_sampling


def test_reinforce_pp_without_dynamic_sampling_is_accepted():
    assert validate(_cfg("reinforce_pp", False)).train.advantage == "reinforce_pp"


def test_the_flag_matches_what_the_estimators_give_an_equal_group():
    from rlrepro.trainer.advantages import zeroes_equal_groups

    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0], [0.3, 0.3, 0.3, 0.3]])
    for mode in ADVANTAGE_MODES:
        adv = compute_advantages(rewards, mode)
        equal_rows = adv[[0, 2]]
        if zeroes_equal_groups(mode):
            assert equal_rows.abs().max() < 1e-6, mode
        else:
            assert equal_rows.abs().min() > 0.1, mode

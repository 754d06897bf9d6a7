"""A reward for systems tests on random weights only: a deterministic pseudo-random value in [0, 1] from the
completion text (sha256), so advantages and gradients are non-zero and every part of a step is exercised.
It teaches nothing. Use as `reward.fn=systems_reward:pseudo_reward` with scripts/ on PYTHONPATH."""
import hashlib


def pseudo_reward(completion: str, record) -> float:
    digest = hashlib.sha256(f"{record.uid}\x00{completion}".encode()).digest()
    return int.from_bytes(digest[:4], "little") / 0xFFFFFFFF

"""``train.collective_timeout_s``: how long a collective of the trainer ranks' group may wait for its slowest rank
(it was a fixed 600 s). Checked before any work, handed to the group's store and ``init_process_group``, and
bit-neutral on resume (a failure or not; it changes no number). And the ``.wandb`` log reader that tells a resumed
run which rows a killed one left on disk: zero-filled space skipped as leveldb skips it."""
from __future__ import annotations

import copy
import datetime

import pytest

from rlrepro.checks import ConfigError
from rlrepro.orchestration.resume import reconcile_resume
from rlrepro.trainer import TrainConfig
from test_resume_config import recorded_config


def test_default_and_bad_values():
    assert TrainConfig().collective_timeout_s == 600.0
    assert TrainConfig(collective_timeout_s=1800).collective_timeout_s == 1800
    for bad in (0, -5, float("nan"), float("inf"), "10m", True):
        with pytest.raises(ConfigError, match=r"train\.collective_timeout_s") as err:
            TrainConfig(collective_timeout_s=bad)
        assert "positive number of seconds" in str(err.value) and "1800" in str(err.value)


def test_resume_may_change_it():
    rec = recorded_config(collective_timeout_s=600.0)
    req = copy.deepcopy(rec)
    req["train"]["collective_timeout_s"] = 3600.0
    config, amendments = reconcile_resume(rec, req, completed_step=3)
    assert config["train"]["collective_timeout_s"] == 3600.0
    assert amendments == [{"key": "train.collective_timeout_s", "old": 600.0, "new": 3600.0, "from_step": 4}]


def test_the_ranks_group_gets_it(tmp_path, monkeypatch):
    """``TrainerWorker.init_data_parallel`` builds the store and the process group (one real gloo rank here) with
    the configured timeout."""
    import torch.distributed as dist

    from rlrepro.model import write_tiny_checkpoint
    from rlrepro.orchestration import weight_sync
    from rlrepro.orchestration.network import SOCKET_IFNAME_ENVS
    from rlrepro.orchestration.workers import TrainerWorker

    for var in SOCKET_IFNAME_ENVS:  # pinned by the join: restored after the test
        monkeypatch.setenv(var, "lo")
    seen = {}
    real_store, real_group = weight_sync.tcp_store, dist.init_process_group

    def store(host, port, world, rdv, timeout):
        seen["store"] = timeout
        return real_store(host, port, world, rdv, timeout)

    def group(backend, **kw):
        seen["group"] = kw["timeout"]
        return real_group(backend, **kw)

    monkeypatch.setattr(weight_sync, "tcp_store", store)
    monkeypatch.setattr(dist, "init_process_group", group)
    model_dir = write_tiny_checkpoint(tmp_path / "m", seed=3)
    w = TrainerWorker(str(model_dir), TrainConfig(collective_timeout_s=1234.5), temperature=1.0,
                      max_response_length=8, device="cpu", dtype=None, deterministic=True, world_size=1)
    host, port = w.rendezvous_address()
    try:
        assert w.init_data_parallel(host, port) == 0
        assert seen == {"store": datetime.timedelta(seconds=1234.5), "group": datetime.timedelta(seconds=1234.5)}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_wandb_log_reader_skips_zero_filled_space():
    """A ``.wandb`` log with a zero-filled stretch to its block's end (leveldb's "zero type", which leveldb's reader
    skips) and rows after it: every row is read (before: the reader stopped at the first zero header, so a resumed
    run took fewer rows as on disk and logged the later ones twice)."""
    import struct
    import zlib

    from rlrepro.orchestration.runlog import _log_records

    def chunk(kind, data):
        return struct.pack("<IHB", zlib.crc32(data), len(data), kind) + data

    out = bytearray(b":W&B\xe1\xbe\x00") + chunk(1, b"row1") + chunk(1, b"row2")
    out.extend(b"\0" * (32768 - len(out)))  # zero-filled up to the block's end
    out.extend(chunk(1, b"row3") + chunk(2, b"ro") + chunk(4, b"w4") + b"\0" * 21 + chunk(1, b"row5"))
    assert list(_log_records(bytes(out))) == [b"row1", b"row2", b"row3", b"row4", b"row5"]
    assert list(_log_records(bytes(out[:-3]))) == [b"row1", b"row2", b"row3", b"row4"]  # a torn tail ends it
    bad = bytes(out[:32768]) + chunk(9, b"row3") + chunk(1, b"row4")
    assert list(_log_records(bad)) == [b"row1", b"row2"]  # an unknown kind still ends the records

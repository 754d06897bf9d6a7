"""One file-mode policy: every file rlrepro writes gets the mode ``open()`` would give it (0o666 & ~umask),
atomic writes (mkstemp) and safetensors' files included (docs/RUN_DIRECTORY.md, "File modes")."""
import os
import stat

import pytest
import torch

from rlrepro import _files
from rlrepro.model import load_pretrained, save_pretrained, write_tiny_checkpoint
from rlrepro.repro.records import CONFIG_FILE, MetricsWriter, RolloutWriter, atomic_write_bytes
from rlrepro.trainer.checkpoint import save_checkpoint


@pytest.fixture(params=[0o022, 0o077, 0o002], ids=["umask022", "umask077", "umask002"])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _modes(root):
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = stat.S_IMODE(os.stat(p).st_mode)
    return out


def _open_mode(tmp_path):
    ref = tmp_path / "reference_open"
    with open(ref, "w"):
        pass
    return stat.S_IMODE(os.stat(ref).st_mode)


def test_umask_read_without_changing_it(umask, monkeypatch):
    assert _files.current_umask() == umask and _files.default_file_mode() == 0o666 & ~umask

    def no_proc(*a, **k):
        raise OSError("no /proc")

    monkeypatch.setattr(_files, "open", no_proc, raising=False)
    assert _files.current_umask() == umask
    assert os.umask(umask) == umask        # the fallback put it back


def test_run_directory_records_get_open_mode(tmp_path, umask):
    expected = {0o022: 0o644, 0o077: 0o600, 0o002: 0o664}[umask]
    assert _open_mode(tmp_path) == expected
    run = tmp_path / "run"
    atomic_write_bytes(run / CONFIG_FILE, b"run:\n  seed: 0\n")           # how the driver writes config.yaml
    RolloutWriter(run).write(1, [{"prompt_uid": "a", "sample_index": 0, "prompt_token_ids": [1],
                                  "token_ids": [2], "logprobs": [-0.5], "reward": 1.0, "advantage": 0.0}])
    m = MetricsWriter(run)
    m.write({"step": 1})
    m.write({"step": 2})
    m.truncate_from(2)                                                     # rewritten atomically
    assert _modes(run) == {"config.yaml": expected, "metrics.jsonl": expected,
                           os.path.join("rollouts", "step_000001.jsonl.gz"): expected}


def test_checkpoint_and_model_dir_files_get_open_mode(tmp_path, umask):
    expected = _open_mode(tmp_path)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    opt.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    path = save_checkpoint(tmp_path / "ckpt", 3, model=model, optimizer=opt, scheduler=sched,
                           extra_state={"cursor": 1})
    modes = _modes(path)
    assert set(modes) == {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "extra_state.pt",
                          "manifest.json"}
    assert modes == dict.fromkeys(modes, expected)
    # HF model directories (base_model/, export_hf): safetensors shards and copied tokenizer files too
    src = write_tiny_checkpoint(tmp_path / "tiny", seed=0)
    os.chmod(src / "tokenizer.json", 0o400)                                # a read-only source
    out = save_pretrained(load_pretrained(src), tmp_path / "exported", max_shard_bytes=20000)
    modes = _modes(out)
    assert sum(n.endswith(".safetensors") for n in modes) > 1 and "tokenizer.json" in modes
    assert modes == dict.fromkeys(modes, expected)
    assert _modes(src) == {**dict.fromkeys(_modes(src), expected), "tokenizer.json": 0o400}

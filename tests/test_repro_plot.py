"""``rlrepro plot`` and the offline wandb comparison."""
import struct

import pytest
import torch
from omegaconf import OmegaConf

from rlrepro.repro.fingerprint import FingerprintWriter, MetricsWriter, fingerprint_step
from rlrepro.repro.plot import PLOT_METRICS, first_divergences, log_comparison_to_wandb, main_plot, plot_runs
from rlrepro.repro.records import ReproError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(path, steps=12, diverge_at=None):
    path.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"run": {"dir": str(path), "seed": 0}}), path / "config.yaml")
    fw, mw = FingerprintWriter(path), MetricsWriter(path)
    for s in range(1, steps + 1):
        off = 0.05 * (s - diverge_at + 1) if diverge_at is not None and s >= diverge_at else 0.0
        tok = [[s, 1, 2], [s, 3]] if off == 0.0 else [[s, 1, 2], [s, 4]]
        fw.write(fingerprint_step(s, prompt_ids=[[0], [0]], token_ids=tok, logprobs=[[-0.5] * 3, [-0.25] * 2],
                                  rewards=[1.0, 0.0], advantages=[0.5, -0.5], loss=0.1 / s + off, grad_norm=1.0,
                                  weights={"w": torch.full((2,), float(s))}))
        mw.write({"step": s, "rollout/reward_mean": 0.1 * s + off, "rollout/response_length_mean": 100.0 + s,
                  "train/loss": 1.0 / s + off, "train/grad_norm": 2.0 - 0.1 * s, "train/kl": 0.001 * s,
                  "train/entropy": 2.0 - 0.05 * s - off, "train/rollout_logprob_abs_diff": 0.0,
                  "perf/step_time_s": 0.5})
    return path


def _check_png(p):
    data = p.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    w, h = struct.unpack(">II", data[16:24])
    assert w >= 300 and h >= 200 and len(data) > 5000
    return w, h


def test_plot_runs_writes_valid_pngs(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b")
    c = make_run(tmp_path / "c", diverge_at=7)
    assert first_divergences([a, b, c]) == {1: None, 2: 7}
    out = tmp_path / "plots"
    paths = plot_runs([a, b, c], out)
    assert [p.name for p in paths] == [f"{stem}.png" for _, stem, _ in PLOT_METRICS] + ["overview.png"]
    sizes = {p.name: _check_png(p) for p in paths}
    assert sizes["overview.png"][0] > sizes["loss.png"][0]


def test_main_plot_single_run_default_out_and_errors(tmp_path, capsys):
    a = make_run(tmp_path / "a", steps=3)
    assert main_plot([str(a)]) == 0
    assert (a / "plots" / "overview.png").exists()
    assert str(a / "plots" / "loss.png") in capsys.readouterr().out
    assert main_plot([str(tmp_path / "missing")]) == 2
    assert "run directory not found" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReproError, match="no metrics.jsonl"):
        plot_runs([tmp_path / "empty"], tmp_path / "o")


def test_wandb_comparison_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    a = make_run(tmp_path / "a", steps=4)
    b = make_run(tmp_path / "b", steps=4, diverge_at=3)
    dirs = log_comparison_to_wandb([a, b], project="rlrepro-test", wandb_dir=tmp_path / "wb")
    assert len(dirs) == 2
    for d in dirs:
        files = list((tmp_path / "wb" / "wandb").glob("offline-run-*/*.wandb"))
        assert files and all(f.stat().st_size > 0 for f in files)
        assert "offline-run-" in d
    with pytest.raises(ValueError):
        log_comparison_to_wandb([a], mode="online")

"""``rlrepro plot`` and the offline wandb comparison."""
import json
import struct

import pytest
import torch
from omegaconf import OmegaConf

from rlrepro.repro.diff import read_metrics
from rlrepro.repro.fingerprint import FingerprintWriter, MetricsWriter, fingerprint_step
from rlrepro.repro.plot import (
    PLOT_METRICS,
    build_figures,
    first_divergences,
    kl_is_off,
    log_comparison_to_wandb,
    main_plot,
    plot_runs,
)
from rlrepro.repro.records import ReproError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(path, steps=12, diverge_at=None, kl=0.001, kl_coef=None, lp_diff=0.0, overlap=False):
    path.mkdir(parents=True)
    cfg = {"run": {"dir": str(path), "seed": 0}}
    if kl_coef is not None:
        cfg["train"] = {"kl_coef": kl_coef}
    OmegaConf.save(OmegaConf.create(cfg), path / "config.yaml")
    fw, mw = FingerprintWriter(path), MetricsWriter(path)
    for s in range(1, steps + 1):
        off = 0.05 * (s - diverge_at + 1) if diverge_at is not None and s >= diverge_at else 0.0
        tok = [[s, 1, 2], [s, 3]] if off == 0.0 else [[s, 1, 2], [s, 4]]
        fw.write(fingerprint_step(s, prompt_ids=[[0], [0]], token_ids=tok, logprobs=[[-0.5] * 3, [-0.25] * 2],
                                  rewards=[1.0, 0.0], advantages=[0.5, -0.5], loss=0.1 / s + off, grad_norm=1.0,
                                  weights={"w": torch.full((2,), float(s))}))
        mw.write({"step": s, "rollout/reward_mean": 0.1 * s + off, "rollout/response_length_mean": 100.0 + s,
                  "train/loss": 1.0 / s + off, "train/grad_norm": 2.0 - 0.1 * s, "train/kl": kl * s,
                  "train/entropy": 2.0 - 0.05 * s - off, "train/rollout_logprob_abs_diff": lp_diff * (s % 2),
                  "perf/step_time_s": 0.5, **({"perf/overlap_s": 0.1} if overlap else {})})
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
    assert [p.name for p in paths] == [f"{m[1]}.png" for m in PLOT_METRICS] + ["overview.png"]
    assert "rollout_logprob_abs_diff.png" in {p.name for p in paths} and "kl.png" in {p.name for p in paths}
    sizes = {p.name: _check_png(p) for p in paths}
    assert sizes["overview.png"][0] > sizes["loss.png"][0]


def _visible_axes(fig):
    return [ax for ax in fig.axes if ax.get_visible()]


def test_every_panel_has_a_y_label_and_the_logprob_diff_panel(tmp_path):
    a = make_run(tmp_path / "a", steps=5)
    b = make_run(tmp_path / "b", steps=5)
    figs = build_figures([a, b])
    assert list(figs) == [m[1] for m in PLOT_METRICS] + ["overview"]
    overview = _visible_axes(figs["overview"])
    assert [ax.get_title() for ax in overview] == [m[2] for m in PLOT_METRICS]
    for fig in figs.values():
        for ax in _visible_axes(fig):
            assert ax.get_ylabel().strip() and ax.get_xlabel() == "step", ax.get_title()
    for ax in (_visible_axes(figs["rollout_logprob_abs_diff"])[0], overview[-1]):
        assert ax.get_title() == "trainer vs rollout logprob" and "logprob" in ax.get_ylabel()
        assert ax.get_yscale() == "linear"
        lo, hi = ax.get_ylim()
        assert lo < 0.0 < hi                                   # the zero line is inside the plot, not an edge
        assert [t.get_text() for t in ax.texts] == ["max = 0.0 (exactly on-policy)"]
        assert [list(line.get_ydata()) for line in ax.lines] == [[0.0] * 5] * 2


def test_logprob_diff_note_names_a_nonzero_maximum(tmp_path):
    a = make_run(tmp_path / "a", steps=4)
    b = make_run(tmp_path / "b", steps=4, lp_diff=2.5e-7)
    ax = _visible_axes(build_figures([a, b], mark_divergence=False)["rollout_logprob_abs_diff"])[0]
    assert [t.get_text() for t in ax.texts] == ["max = 2.5e-07 (b): not exactly on-policy"]
    assert ax.get_yscale() == "linear"


def test_no_kl_panel_when_the_kl_term_is_off(tmp_path):
    zero = make_run(tmp_path / "zero", steps=3, kl=0.0)                  # every recorded train/kl is 0
    coef0 = make_run(tmp_path / "coef0", steps=3, kl_coef=0.0)           # config says the term is off
    on = make_run(tmp_path / "on", steps=3, kl_coef=0.001)
    no_kl = make_run(tmp_path / "no_kl", steps=3)
    recs = [json.loads(x) for x in (no_kl / "metrics.jsonl").read_text().splitlines()]
    (no_kl / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "train/kl"}) + "\n"
                                                 for r in recs))
    assert kl_is_off([zero, coef0, no_kl], [read_metrics(r) for r in (zero, coef0, no_kl)])
    assert not kl_is_off([zero, on], [read_metrics(r) for r in (zero, on)])
    for runs, has_kl in (([zero], False), ([coef0], False), ([no_kl], False),
                         ([on], True), ([zero, on], True)):
        figs = build_figures(runs, mark_divergence=False)
        titles = [ax.get_title() for ax in _visible_axes(figs["overview"])]
        assert ("kl" in figs) is has_kl and ("KL" in titles) is has_kl, [r.name for r in runs]
        assert len(titles) == len(PLOT_METRICS) - (0 if has_kl else 1)
    paths = plot_runs([zero], tmp_path / "out")
    assert "kl.png" not in {p.name for p in paths} and (tmp_path / "out" / "overview.png").exists()


def test_main_plot_single_run_default_out_and_errors(tmp_path, capsys):
    a = make_run(tmp_path / "a", steps=3)
    assert main_plot([str(a)]) == 0
    assert (a / "plots" / "overview.png").exists()
    assert str(a / "plots" / "loss.png") in capsys.readouterr().out
    assert main_plot([str(tmp_path / "missing")]) == 2
    assert f"run directory {tmp_path / 'missing'} not found" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")  # --out naming a file: a message and exit 2, not a traceback
    assert main_plot([str(a), "--out", str(tmp_path / "afile")]) == 2
    assert f"rlrepro plot: error: --out {tmp_path / 'afile'}: " in capsys.readouterr().err
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


def test_eval_and_dynamic_sampling_curves_get_panels_when_recorded(tmp_path):
    plain = make_run(tmp_path / "plain", steps=3)
    ev = make_run(tmp_path / "ev", steps=4)
    recs = [json.loads(x) for x in (ev / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        r["rollout/groups_kept"] = 3
        if r["step"] % 2 == 0:  # evaluated every 2 steps
            r.update({"eval/avg@4": 0.1 * r["step"], "eval/pass@4": 0.2 * r["step"], "eval/greedy_acc": 0.5})
    (ev / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert "eval_avg_at_4" not in build_figures([plain], mark_divergence=False)
    figs = build_figures([plain, ev], mark_divergence=False)
    for stem in ("eval_avg_at_4", "eval_pass_at_4", "eval_greedy_acc", "groups_kept"):
        assert stem in figs, stem
    ax = figs["eval_avg_at_4"].axes[0]
    assert ax.get_title() == "eval avg@4 (held out)"
    (line,) = [ln for ln in ax.get_lines() if ln.get_label() == "ev"]
    assert list(line.get_xdata()) == [2, 4] and list(line.get_ydata()) == [0.2, 0.4]
    titles = [a.get_title() for a in _visible_axes(figs["overview"])]
    assert "eval pass@4 (held out)" in titles


def test_plot_skips_a_run_it_cannot_read_and_draws_the_others(tmp_path, capsys):
    a = make_run(tmp_path / "a", steps=4)
    torn = make_run(tmp_path / "torn", steps=4)
    with open(torn / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "train/lo')               # a run that crashed (or is still writing)
    bad = make_run(tmp_path / "bad", steps=4)
    lines = (bad / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:20]                            # malformed in the middle: cannot be read
    (bad / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    figs = build_figures([a, bad, tmp_path / "missing", torn])
    err = capsys.readouterr().err
    assert f"rlrepro plot: skipping a run that cannot be read: {bad / 'metrics.jsonl'}:2: invalid JSON" in err
    assert (f"rlrepro plot: skipping a run that cannot be read: run directory {tmp_path / 'missing'} not found; "
            "give the directory a training wrote") in err
    assert f"rlrepro plot: note: {torn / 'metrics.jsonl'}:5: torn last line dropped" in err
    (line_a, line_torn) = [ln for ln in figs["loss"].axes[0].get_lines() if ln.get_label() in ("a", "torn")]
    assert list(line_torn.get_xdata()) == [1, 2, 3, 4] == list(line_a.get_xdata())
    assert main_plot([str(a), str(bad), "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "overview.png").exists()
    assert main_plot([str(bad)]) == 2                   # nothing left to draw
    assert f"rlrepro plot: error: {bad / 'metrics.jsonl'}:2: invalid JSON" in capsys.readouterr().err

"""``rlrepro plot RUN [RUN ...]``: overlay the training curves of runs and mark where they first diverge.

Writes one PNG per metric and ``overview.png`` (a grid of all of them). Uses matplotlib's Agg backend (no display).
The trainer-vs-rollout logprob difference is drawn on a linear axis with its maximum written out, so that an
exact 0.0 (exactly on-policy) shows as such; the KL panel is left out when the KL term is off in every run.
``log_comparison_to_wandb`` logs the same curves as a wandb group, offline (never network).
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from .diff import ReproError, diff_runs, load_config, read_metrics
from .records import missing_run_dir

__all__ = ["PLOT_METRICS", "plot_runs", "build_figures", "plot_panels", "kl_is_off", "main_plot",
           "log_comparison_to_wandb", "first_divergences", "readable_runs"]

KL_KEY = "train/kl"
LOGPROB_DIFF_KEY = "train/rollout_logprob_abs_diff"

#: (metrics.jsonl key, file stem, title, y-axis label)
PLOT_METRICS = (
    ("rollout/reward_mean", "reward_mean", "reward mean", "reward"),
    ("train/loss", "loss", "loss", "loss"),
    (KL_KEY, "kl", "KL", "KL to reference"),
    ("train/entropy", "entropy", "entropy", "entropy (nats / token)"),
    ("rollout/response_length_mean", "response_length_mean", "response length (mean)", "tokens"),
    ("train/grad_norm", "grad_norm", "grad norm", "gradient L2 norm"),
    (LOGPROB_DIFF_KEY, "rollout_logprob_abs_diff", "trainer vs rollout logprob", "max |logprob difference|"),
)


def _labels(run_dirs: Sequence[Path]) -> list[str]:
    names = [p.resolve().name or str(p) for p in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [str(p) for p in run_dirs]


def _series(metrics: dict[int, dict] | None, key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for step, rec in sorted((metrics or {}).items()):
        v = rec.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        xs.append(step)
        ys.append(float(v))
    return xs, ys


def first_divergences(run_dirs: Sequence[str | os.PathLike]) -> dict[int, int | None]:
    """``{i: first divergent step of run i vs run 0}`` for i >= 1 (None when identical or not comparable)."""
    out: dict[int, int | None] = {}
    for i in range(1, len(run_dirs)):
        try:
            out[i] = diff_runs(run_dirs[0], run_dirs[i], detail=False).first_divergent_step
        except ReproError as e:
            print(f"rlrepro plot: note: no divergence marker for {run_dirs[i]}: {e}", file=sys.stderr)
            out[i] = None
    return out


def _kl_coef(run_dir: Path) -> float | None:
    try:
        cfg = load_config(run_dir)
    except ReproError:
        return None
    coef = ((cfg or {}).get("train") or {}).get("kl_coef")
    return float(coef) if isinstance(coef, (int, float)) and not isinstance(coef, bool) else None


def kl_is_off(run_dirs: Sequence[str | os.PathLike], metrics: Sequence[dict | None]) -> bool:
    """True when no run has a KL term: each run's config.yaml says ``train.kl_coef: 0``, or every ``train/kl`` it
    recorded is 0 (or absent)."""
    for run_dir, m in zip(run_dirs, metrics):
        if _kl_coef(Path(run_dir)) == 0.0:
            continue
        if any(v != 0.0 for v in _series(m, KL_KEY)[1]):
            return False
    return True


#: panels drawn only when some run recorded the key (evaluation, dynamic sampling); ``@k`` keys are found by prefix
OPTIONAL_PLOT_METRICS = (
    ("eval/avg@", "eval_avg", "eval avg@{k} (held out)", "mean reward"),
    ("eval/pass@", "eval_pass", "eval pass@{k} (held out)", "pass@k"),
    ("eval/greedy_acc", "eval_greedy_acc", "eval greedy accuracy", "accuracy"),
    ("rollout/groups_kept", "groups_kept", "dynamic sampling: groups kept", "groups"),
)


def _optional_panels(metrics: Sequence[dict | None]) -> list[tuple]:
    keys = sorted({k for m in metrics for rec in (m or {}).values() for k in rec})
    out = []
    for prefix, stem, title, ylabel in OPTIONAL_PLOT_METRICS:
        if prefix.endswith("@"):
            for key in (k for k in keys if k.startswith(prefix) and k[len(prefix):].isdigit()):
                k = key[len(prefix):]
                out.append((key, f"{stem}_at_{k}", title.format(k=k), ylabel))
        elif prefix in keys:
            out.append((prefix, stem, title, ylabel))
    return out


def plot_panels(run_dirs: Sequence[str | os.PathLike], metrics: Sequence[dict | None]) -> list[tuple]:
    """The PLOT_METRICS entries drawn for these runs (without KL when :func:`kl_is_off`), then the evaluation and
    dynamic-sampling curves of OPTIONAL_PLOT_METRICS that some run recorded."""
    skip_kl = kl_is_off(run_dirs, metrics)
    return [m for m in PLOT_METRICS if not (skip_kl and m[0] == KL_KEY)] + _optional_panels(metrics)


def _logprob_diff_note(labels: list[str], metrics: list[dict | None]) -> str | None:
    """"max = 0.0 (exactly on-policy)" when every recorded value is exactly 0, else the largest value and its run."""
    best: tuple[float, str] | None = None
    nan_runs = []
    for lab, m in zip(labels, metrics):
        ys = _series(m, LOGPROB_DIFF_KEY)[1]
        if any(math.isnan(y) for y in ys):
            nan_runs.append(lab)
        for y in ys:
            if not math.isnan(y) and (best is None or y > best[0]):
                best = (y, lab)
    if best is None:
        return None
    if best[0] == 0.0 and not nan_runs:
        return "max = 0.0 (exactly on-policy)"
    stale = [lab for lab, m in zip(labels, metrics) if _series(m, "perf/overlap_s")[1]]  # rollout.max_staleness > 0
    why = ": not exactly on-policy"
    if stale and best[1] in stale:  # max |proximal - behaviour|: how stale the pipelined batches are, by design
        why = ": stale by design (rollout.max_staleness > 0: trainer vs the older policy that sampled)"
    note = f"max = {best[0]:.3g}" + (f" ({best[1]})" if len(labels) > 1 else "") + why
    return note + (f"; NaN in {', '.join(nan_runs)}" if nan_runs else "")


def _draw(ax, key: str, title: str, labels: list[str], metrics: list[dict | None], colors: list,
          divergence: dict[int, int | None], ylabel: str = "") -> None:
    any_data = False
    for i, (lab, m) in enumerate(zip(labels, metrics)):
        xs, ys = _series(m, key)
        if not xs:
            continue
        any_data = True
        # later runs dashed so that identical curves stay visible on top of each other
        ax.plot(xs, ys, label=lab, color=colors[i], linewidth=1.6 if i == 0 else 1.2,
                linestyle="-" if i == 0 else (0, (4, 2 + i)), marker="o" if len(xs) <= 30 else None,
                markersize=3)
    for i, step in divergence.items():
        if step is not None:
            ax.axvline(step, color=colors[i], linestyle=":", linewidth=1.2, label=f"{labels[i]} diverges @ {step}")
    if not any_data:
        ax.text(0.5, 0.5, f"no data for {key}", transform=ax.transAxes, ha="center", va="center", color="gray")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel or title)
    ax.grid(True, alpha=0.3)
    note = _logprob_diff_note(labels, metrics) if key == LOGPROB_DIFF_KEY else None
    if note is not None:
        # linear axis, no offset: an exact zero must read as 0, not as a tiny number on a log scale
        ax.set_yscale("linear")
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        if note.startswith("max = 0.0 "):
            ax.set_ylim(-1.0, 1.0)
        ax.text(0.02, 0.96, note, transform=ax.transAxes, ha="left", va="top", fontsize="small",
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
    if any_data or any(s is not None for s in divergence.values()):
        ax.legend(fontsize="small")


def readable_runs(run_dirs: Sequence[str | os.PathLike]) -> tuple[list[Path], list[dict | None]]:
    """The runs that can be read, with their metrics (None: no metrics.jsonl). A run that cannot be read (missing,
    or a corrupt metrics.jsonl) is skipped with a message on stderr; a torn last line is dropped with a note.
    ReproError when none is left (naming why each was skipped)."""
    dirs = [Path(p) for p in run_dirs]
    if not dirs:
        raise ReproError("no run directories given")
    keep: list[Path] = []
    metrics: list[dict | None] = []
    skipped: list[str] = []
    for p in dirs:
        notes: list[str] = []
        try:
            missing = missing_run_dir("plot", p, need_config=False)  # the one wording of every command
            if missing is not None:
                raise ReproError(missing)
            m = read_metrics(p, notes)
        except ReproError as e:
            skipped.append(str(e))
            if len(dirs) > 1:
                print(f"rlrepro plot: skipping a run that cannot be read: {e}", file=sys.stderr)
            continue
        for n in notes:
            print(f"rlrepro plot: note: {n}", file=sys.stderr)
        if m is not None and not m:  # an empty metrics.jsonl: empty panels would say nothing
            empty = (f"{p / 'metrics.jsonl'}: no step recorded yet (the run has not finished its first step): "
                     "nothing to plot; plot it once a step is done")
            skipped.append(empty)
            if len(dirs) > 1:
                print(f"rlrepro plot: leaving out a run: {empty}", file=sys.stderr)
            continue
        keep.append(p)
        metrics.append(m)
    if not keep:
        raise ReproError("; ".join(skipped) if len(skipped) == 1 else "no run can be read: " + "; ".join(skipped))
    return keep, metrics


def build_figures(run_dirs: Sequence[str | os.PathLike], *, mark_divergence: bool = True) -> dict[str, object]:
    """The figures ``plot_runs`` writes, as ``{file stem: matplotlib Figure}`` (one per panel of
    :func:`plot_panels`, then ``"overview"``). A run that cannot be read is skipped (:func:`readable_runs`).
    ReproError when no run has a readable metrics.jsonl."""
    # Figure + the Agg canvas directly: no pyplot, no global backend switch, no display needed
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    dirs, metrics = readable_runs(run_dirs)
    if all(m is None for m in metrics):
        raise ReproError("no metrics.jsonl in " + ", ".join(str(p) for p in dirs))
    labels = _labels(dirs)
    colors = [colormaps["tab10"](i % 10) for i in range(len(dirs))]
    divergence = first_divergences(dirs) if mark_divergence and len(dirs) > 1 else {}
    panels = plot_panels(dirs, metrics)

    figures: dict[str, object] = {}
    for key, stem, title, ylabel in panels:
        fig = Figure(figsize=(7, 4.2), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        _draw(ax, key, title, labels, metrics, colors, divergence, ylabel)
        fig.tight_layout()
        figures[stem] = fig
    ncols = 3
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(6 * ncols, 3.8 * nrows), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax, (key, _, title, ylabel) in zip(axes.flat, panels):
        _draw(ax, key, title, labels, metrics, colors, divergence, ylabel)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(" vs ".join(labels) if len(labels) <= 4 else f"{len(labels)} runs")
    fig.tight_layout()
    figures["overview"] = fig
    return figures


def plot_runs(run_dirs: Sequence[str | os.PathLike], out_dir: str | os.PathLike, *,
              mark_divergence: bool = True) -> list[Path]:
    """Overlay the curves of ``run_dirs`` (from each run's metrics.jsonl); one PNG per panel (PLOT_METRICS, without
    ``kl.png`` when the KL term is off in every run) plus ``overview.png``. With ``mark_divergence`` a dotted
    vertical line marks where run i first diverges from run 0 (``diff_runs``). Returns the written paths.
    ReproError when no run has a readable metrics.jsonl."""
    figures = build_figures(run_dirs, mark_divergence=mark_divergence)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for stem, fig in figures.items():
        path = out / f"{stem}.png"
        fig.savefig(path)
        written.append(path)
    return written


def log_comparison_to_wandb(run_dirs: Sequence[str | os.PathLike], project: str | None = None, *,
                            group: str | None = None, mode: str = "offline",
                            wandb_dir: str | os.PathLike | None = None) -> list[str]:
    """Log each run's metrics.jsonl as one wandb run of a shared group, so wandb overlays the curves; the first
    divergent step vs run 0 goes into each run's summary (``repro/first_divergent_step``).

    ``mode`` is "offline" (default) or "disabled": this never talks to the network; ``wandb sync`` uploads later.
    Files go under ``wandb_dir`` (default: the first run directory). Returns the wandb run directories written.
    """
    if mode not in ("offline", "disabled"):
        raise ValueError(f"mode must be 'offline' or 'disabled', not {mode!r} (rlrepro never logs online here)")
    import wandb

    dirs, all_metrics = readable_runs(run_dirs)
    labels = _labels(dirs)
    if group is None:
        group = "compare-" + hashlib.sha256("\0".join(str(p.resolve()) for p in dirs).encode()).hexdigest()[:8]
    divergence = first_divergences(dirs) if len(dirs) > 1 else {}
    base = Path(wandb_dir) if wandb_dir is not None else dirs[0]
    base.mkdir(parents=True, exist_ok=True)
    settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, x_disable_meta=True,
                              disable_git=True, disable_code=True)
    out: list[str] = []
    for i, (p, lab, metrics) in enumerate(zip(dirs, labels, all_metrics)):
        metrics = metrics or {}
        run = wandb.init(project=project or "rlrepro-compare", group=group, name=lab, job_type="compare",
                         mode=mode, dir=str(base), config={"run_dir": str(p.resolve())}, settings=settings)
        try:
            for step, rec in sorted(metrics.items()):
                row: dict[str, Any] = {k: v for k, v in rec.items()
                                       if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
                if row:
                    run.log(row, step=step)
            run.summary["repro/first_divergent_step"] = divergence.get(i)
            run.summary["repro/reference_run"] = labels[0]
            out.append(str(getattr(run.settings, "sync_dir", None) or run.dir))
        finally:
            run.finish()
    return out


def main_plot(argv: Sequence[str] | None = None) -> int:
    """``rlrepro plot RUN [RUN ...] [--out DIR] [--no-divergence] [--wandb] [--project P]``: 0 ok, 2 error."""
    parser = argparse.ArgumentParser(prog="rlrepro plot",
                                     description="Overlay the curves of one or more runs; mark the first divergence.")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--out", default=None, help="output directory (default: FIRST_RUN/plots)")
    parser.add_argument("--no-divergence", action="store_true", help="do not mark divergent steps")
    parser.add_argument("--wandb", action="store_true", help="also log the curves as an offline wandb group")
    parser.add_argument("--project", default=None, help="wandb project name (with --wandb)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code in (0, None) else 2
    out = args.out or str(Path(args.runs[0]) / "plots")
    try:
        paths = plot_runs(args.runs, out, mark_divergence=not args.no_divergence)
        for p in paths:
            print(p)
        if args.wandb:
            for d in log_comparison_to_wandb(args.runs, project=args.project):
                print(f"wandb (offline): {d}")
    except ReproError as e:
        print(f"rlrepro plot: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. --out names a file, or a folder that cannot be written
        print(f"rlrepro plot: error: --out {out}: {e.strerror or e}; give a directory to write the plots into",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_plot())

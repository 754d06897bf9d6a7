"""``rlrepro plot RUN [RUN ...]``: overlay the training curves of runs and mark where they first diverge.

Writes one PNG per metric and ``overview.png`` (a grid of all of them). Uses matplotlib's Agg backend (no display).
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

from .diff import ReproError, diff_runs, read_metrics

__all__ = ["PLOT_METRICS", "plot_runs", "main_plot", "log_comparison_to_wandb", "first_divergences"]

#: (metrics.jsonl key, file stem, title)
PLOT_METRICS = (
    ("rollout/reward_mean", "reward_mean", "reward mean"),
    ("train/loss", "loss", "loss"),
    ("train/kl", "kl", "KL"),
    ("train/entropy", "entropy", "entropy"),
    ("rollout/response_length_mean", "response_length_mean", "response length (mean)"),
    ("train/grad_norm", "grad_norm", "grad norm"),
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


def _draw(ax, key: str, title: str, labels: list[str], metrics: list[dict | None], colors: list,
          divergence: dict[int, int | None]) -> None:
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
    ax.grid(True, alpha=0.3)
    if any_data or any(s is not None for s in divergence.values()):
        ax.legend(fontsize="small")


def plot_runs(run_dirs: Sequence[str | os.PathLike], out_dir: str | os.PathLike, *,
              mark_divergence: bool = True) -> list[Path]:
    """Overlay the curves of ``run_dirs`` (from each run's metrics.jsonl); one PNG per metric in PLOT_METRICS plus
    ``overview.png``. With ``mark_divergence`` a dotted vertical line marks where run i first diverges from run 0
    (``diff_runs``). Returns the written paths. ReproError when no run has a readable metrics.jsonl."""
    # Figure + the Agg canvas directly: no pyplot, no global backend switch, no display needed
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    dirs = [Path(p) for p in run_dirs]
    if not dirs:
        raise ReproError("no run directories given")
    for p in dirs:
        if not p.is_dir():
            raise ReproError(f"{p}: run directory not found")
    metrics = [read_metrics(p) for p in dirs]
    if all(m is None for m in metrics):
        raise ReproError("no metrics.jsonl in " + ", ".join(str(p) for p in dirs))
    labels = _labels(dirs)
    colors = [colormaps["tab10"](i % 10) for i in range(len(dirs))]
    divergence = first_divergences(dirs) if mark_divergence and len(dirs) > 1 else {}

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for key, stem, title in PLOT_METRICS:
        fig = Figure(figsize=(7, 4.2), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        _draw(ax, key, title, labels, metrics, colors, divergence)
        fig.tight_layout()
        path = out / f"{stem}.png"
        fig.savefig(path)
        written.append(path)
    ncols = 3
    nrows = math.ceil(len(PLOT_METRICS) / ncols)
    fig = Figure(figsize=(6 * ncols, 3.8 * nrows), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax, (key, _, title) in zip(axes.flat, PLOT_METRICS):
        _draw(ax, key, title, labels, metrics, colors, divergence)
    for ax in list(axes.flat)[len(PLOT_METRICS):]:
        ax.set_visible(False)
    fig.suptitle(" vs ".join(labels) if len(labels) <= 4 else f"{len(labels)} runs")
    fig.tight_layout()
    path = out / "overview.png"
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

    dirs = [Path(p) for p in run_dirs]
    for p in dirs:
        if not p.is_dir():
            raise ReproError(f"{p}: run directory not found")
    labels = _labels(dirs)
    if group is None:
        group = "compare-" + hashlib.sha256("\0".join(str(p.resolve()) for p in dirs).encode()).hexdigest()[:8]
    divergence = first_divergences(dirs) if len(dirs) > 1 else {}
    base = Path(wandb_dir) if wandb_dir is not None else dirs[0]
    base.mkdir(parents=True, exist_ok=True)
    settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, x_disable_meta=True,
                              disable_git=True, disable_code=True)
    out: list[str] = []
    for i, (p, lab) in enumerate(zip(dirs, labels)):
        metrics = read_metrics(p) or {}
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
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_plot())

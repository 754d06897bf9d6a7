"""rlrepro.repro: fingerprints, run records, ``rlrepro diff`` and ``rlrepro plot``.

Names are loaded on first use, so ``rlrepro diff`` (records + diff) never imports torch or matplotlib.
The run-directory format is documented in docs/RUN_DIRECTORY.md.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    # records (no torch)
    "ReproError": "records", "JsonlStepWriter": "records", "MetricsWriter": "records",
    "FingerprintWriter": "records", "RolloutWriter": "records", "read_rollouts": "records",
    "read_step_records": "records", "rollouts_path": "records", "step_dirname": "records",
    "read_rollout_samples": "records", "rollout_steps": "records",
    # digests and fingerprints (torch)
    "tensor_digest": "fingerprint", "tensor_digests": "fingerprint", "digest_values": "fingerprint",
    "weights_digest": "fingerprint", "StepFingerprint": "fingerprint", "fingerprint_step": "fingerprint",
    "fingerprint_from_samples": "fingerprint", "FIELDS": "fingerprint", "optimizer_state_digest": "fingerprint",
    # diff (no torch)
    "DiffReport": "diff", "diff_runs": "diff", "main_diff": "diff", "read_fingerprints": "diff",
    "read_metrics": "diff",
    # plots (matplotlib, wandb on use)
    "plot_runs": "plot", "build_figures": "plot", "main_plot": "plot", "log_comparison_to_wandb": "plot",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

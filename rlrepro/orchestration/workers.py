"""The two kinds of actor. Plain classes: ``ray.remote`` wraps them in :mod:`.driver`, and tests can also
use them in-process. Each fixes its own torch thread count, so CPU results do not depend on how many cores
Ray happens to give the process."""
from __future__ import annotations

import os
from typing import Any

import torch


def _setup_process(device: str, torch_threads: int) -> None:
    torch.set_num_threads(torch_threads)
    if device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class RolloutWorker:
    """One engine. ``generate`` takes keyed requests and returns keyed results; the key never influences the
    numbers (the sampling seed inside the request does)."""

    def __init__(self, model_dir: str, *, device: str, dtype: str | None, deterministic: bool,
                 engine_kwargs: dict, torch_threads: int = 1) -> None:
        _setup_process(device, torch_threads)
        from rlrepro.rollout import Engine

        engine_kwargs = dict(engine_kwargs)
        fraction = engine_kwargs.pop("gpu_memory_fraction", None)
        if device == "cuda" and engine_kwargs.get("num_kv_blocks") is None and fraction:
            engine_kwargs["kv_cache_memory_bytes"] = int(fraction * torch.cuda.get_device_properties(0).total_memory)
        self.engine = Engine(model_dir, device=device, dtype=_dtype(dtype), deterministic=deterministic,
                             **engine_kwargs)

    def generate(self, requests: list[dict]) -> list[dict]:
        from rlrepro.rollout import SamplingParams

        if not requests:
            return []
        outs = self.engine.generate([r["prompt_token_ids"] for r in requests],
                                    [SamplingParams(**r["sampling"]) for r in requests])
        return [{"key": r["key"], "token_ids": list(o.token_ids), "logprobs": list(o.logprobs),
                 "finish_reason": o.finish_reason} for r, o in zip(requests, outs)]

    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> int:
        self.engine.load_weights(weights.items(), version=version)
        return version

    def weight_version(self) -> int:
        return self.engine.weight_version

    def pid(self) -> int:
        return os.getpid()


class TrainerWorker:
    """The policy, its optimizer and its checkpoints."""

    def __init__(self, model_dir: str, *, device: str, dtype: str | None, deterministic: bool,
                 train_kwargs: dict, torch_threads: int = 1) -> None:
        _setup_process(device, torch_threads)
        from rlrepro import kernels
        from rlrepro.model import load_pretrained
        from rlrepro.trainer import Trainer, TrainConfig, enable_determinism

        enable_determinism()
        self.kernel_mode = "deterministic" if deterministic else "fast"
        self.model = load_pretrained(model_dir, device=device, dtype=_dtype(dtype))
        self.train_config = TrainConfig(**train_kwargs)
        # The KL reference is the policy RL starts from: the loaded weights, or the warm-started ones.
        self.ref_model = self._frozen_copy() if self.train_config.kl_coef > 0 else None
        self.trainer = Trainer(self.model, self.train_config, ref_model=self.ref_model)
        self._kernels = kernels

    def train_step(self, samples: list[dict]) -> dict:
        with self._kernels.mode(self.kernel_mode):
            return self.trainer.train_step(samples)

    def warm_start(self, examples: list[tuple[list[int], list[int]]], *, steps: int, lr: float, batch_size: int,
                   seed: int) -> list[float]:
        from .warm_start import supervised_warm_start

        from rlrepro.trainer import Trainer

        with self._kernels.mode(self.kernel_mode):
            losses = supervised_warm_start(self.model, examples, steps=steps, lr=lr, batch_size=batch_size, seed=seed)
        if self.ref_model is not None:
            self.ref_model = self._frozen_copy()
        self.trainer = Trainer(self.model, self.train_config, ref_model=self.ref_model)  # fresh optimizer state
        return losses

    def _frozen_copy(self):
        import copy

        ref = copy.deepcopy(self.model)
        ref.requires_grad_(False)
        return ref.eval()

    def get_weights(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().to("cpu", copy=True) for name, t in self.trainer.named_weights()}

    def weights_digest(self) -> str:
        from rlrepro.repro.fingerprint import weights_digest

        return weights_digest(self.trainer.named_weights())

    def save_checkpoint(self, ckpt_root: str, step: int, extra_state: dict, keep_last: int) -> str:
        return str(self.trainer.save_checkpoint(ckpt_root, step, extra_state=extra_state, keep_last=keep_last))

    def load_checkpoint(self, path: str) -> dict:
        return self.trainer.load_checkpoint(path)

    def export_hf(self, path: str) -> str:
        from rlrepro.trainer import export_hf

        return str(export_hf(self.model, path))

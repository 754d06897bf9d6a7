"""Sharded checkpoints of a :class:`MegatronTrainer` through megatron-core's ``dist_checkpointing``, in rlrepro's
atomic checkpoint layout, and conversion to a full rlrepro checkpoint and to / from HF safetensors.

Every rank writes only its own shards (no gather): each weight, float32 master weight and AdamW moment is described
as a megatron ``ShardedTensor`` (this rank's slice of the full tensor, split along its tensor-parallel dim, or a
replica) and saved with ``dist_checkpointing.save`` (``torch_dist`` strategy = ``torch.distributed.checkpoint``
files, ``validate_access_integrity=True``). Loading describes the *loading* trainer's shards the same way and calls
``dist_checkpointing.load``, which reshards: a checkpoint written at TP=2 loads at TP=1 or TP=2, with any DP.

Layout of ``ckpt_root/step_NNNNNN/`` (``manifest.json`` as :mod:`rlrepro.trainer.checkpoint` writes it, with
``"layout": "megatron-dist"``)::

    dist/               megatron-core's checkpoint directory (*.distcp, .metadata, metadata.json, common.pt)
    dist_meta.json      layout at save time (TP, DP, world), the model config, every saved tensor's full shape/dtype
    optimizer.pt        what is not sharded: parameter names, AdamW param_groups, each parameter's step count
    scheduler.pt        the LR schedule
    rng/rank_NNNNN.pt   capture_rng_state() of every global rank (its own RNGs, plus the named generators)
    extra_state.pt      the caller's dict (data cursor, ...)
    manifest.json       size and sha256 of every file above; written last

Atomicity as in :func:`rlrepro.trainer.checkpoint.save_checkpoint`: everything goes into
``step_NNNNNN.tmp-<pid of rank 0>/``, each rank's files fsynced, the manifest written last by rank 0 and fsynced,
then the directory renamed into place. A failure on any rank is agreed by all ranks (no hang after the megatron
collective), the temporary directory is removed and every rank raises; the previous checkpoint is untouched.
:func:`rlrepro.trainer.checkpoint.latest_checkpoint` / ``verify_checkpoint`` / ``list_checkpoints`` work on these
directories unchanged.

CPU: megatron-core's ``torch_dist`` save calls ``torch.cuda.synchronize()`` and ``torch.cuda.current_device()``
(0.16.1) although nothing else in it needs CUDA; for a model on the CPU (with or without CUDA on the machine) those
two calls are redirected to the CPU for the duration of the save/load (:func:`.mcore.cuda_calls_on_cpu`). Its writer
also needs ``psutil``.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from .. import checkpoint as ckpt
# the layout, save and load live in .dist_format (the trainer imports them from there); re-exported here
from .dist_format import (DIST_DIR, LAYOUT, META, is_dist_checkpoint, load_dist_checkpoint, read_dist_meta,
                          save_dist_checkpoint)

__all__ = ["LAYOUT", "is_dist_checkpoint", "save_dist_checkpoint", "load_dist_checkpoint", "dist_to_full",
           "dist_to_hf", "hf_to_dist", "read_dist_meta", "read_dist_model_state"]


# ---------------------------------------------------------------------------------------------------- conversion

def _read_full_tensors(path: Path, meta: dict, kinds: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Full tensors of the given kinds, read in this process with torch.distributed.checkpoint (no process group,
    no megatron-core needed)."""
    import torch.distributed.checkpoint as dcp

    state = {key: torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))
             for key, info in meta["tensors"].items() if info["kind"] in kinds}
    import warnings

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path / DIST_DIR)), no_dist=True)
    return state


def dist_to_full(path, ckpt_root) -> Path:
    """Convert a megatron-dist checkpoint into a full rlrepro checkpoint ``ckpt_root/step_NNNNNN`` (the format of
    ``Trainer.save_checkpoint``: full model, optimizer with full AdamW moments and masters, schedule, rank 0's RNG
    states, extra_state), in one process without a process group. The result equals what
    ``MegatronTrainer.save_checkpoint(checkpoint_format='full')`` writes at that point, tensor for tensor."""
    path = Path(path)
    manifest = ckpt.verify_checkpoint(path, check_hashes=True)
    meta = read_dist_meta(path)
    tensors = _read_full_tensors(path, meta, ("model", "master", "state"))
    common = ckpt.load_pt(path / "optimizer.pt")
    names = list(common["names"])
    index = {n: i for i, n in enumerate(names)}
    model_state, masters, state = {}, {}, {}
    for key, info in meta["tensors"].items():
        if info["kind"] == "model":
            model_state[info["name"]] = tensors[key]
        elif info["kind"] == "master":
            masters[info["name"]] = tensors[key]
        else:
            state.setdefault(index[info["name"]], {})[info["state_key"]] = tensors[key]
    for name, scalars in common["scalars"].items():
        state.setdefault(index[name], {}).update(scalars)
    state = {i: dict(sorted(per.items())) for i, per in sorted(state.items())}
    optimizer = {"names": names, "adamw": {"state": state, "param_groups": common["param_groups"]},
                 "master_weights": dict(sorted(masters.items()))}
    hold = ckpt.StateHolder
    return ckpt.save_checkpoint(ckpt_root, int(manifest["step"]), model=hold(model_state),
                                optimizer=hold(optimizer), scheduler=hold(ckpt.load_pt(path / "scheduler.pt")),
                                extra_state=ckpt.load_pt(path / "extra_state.pt"),
                                rng_state=ckpt.load_pt(path / "rng" / "rank_00000.pt"))


def read_dist_model_state(path) -> dict[str, torch.Tensor]:
    """The full model tensors (name -> tensor, in the saved compute dtype) of a megatron-dist checkpoint, read in
    this process without a process group or megatron-core (hashes verified first)."""
    path = Path(path)
    ckpt.verify_checkpoint(path, check_hashes=True)
    tensors = _read_full_tensors(path, read_dist_meta(path), ("model",))
    return {key[len("model."):]: t for key, t in tensors.items()}


def dist_to_hf(path, hf_dir, **kwargs) -> Path:
    """Write the policy of a megatron-dist checkpoint as an HF directory (config.json + safetensors, in the saved
    compute dtype) through ``rlrepro.model.save_pretrained``; one process, no process group."""
    from rlrepro.model import Qwen3Config, Qwen3ForCausalLM, save_pretrained

    path = Path(path)
    state = read_dist_model_state(path)
    config = Qwen3Config.from_dict(read_dist_meta(path)["model_config"])
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    dtype = next(iter(state.values())).dtype
    model = model.to_empty(device="cpu").to(dtype)
    model.load_state_dict(state, strict=True)
    return save_pretrained(model, hf_dir, **kwargs)


def hf_to_dist(hf_dir, ckpt_root, train_config, *, step: int = 0, dtype=None, param_dtype=None,
               extra_state: Mapping | None = None) -> Path:
    """Write a megatron-dist checkpoint of the HF model in ``hf_dir`` as a fresh trainer holds it (weights, float32
    masters when ``param_dtype`` differs from the weights' dtype, no AdamW moments yet, the schedule at step 0 of
    ``train_config``), from one process (a 1-rank gloo group is created when none exists). A ``MegatronTrainer`` at
    any TP that divides the model then starts from it with ``load_checkpoint``."""
    import dataclasses

    from .model import TPQwen3ForCausalLM
    from .parallel import single_process_groups
    from .trainer import MegatronTrainer

    own_group = not (dist.is_available() and dist.is_initialized())
    if own_group:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError(f"hf_to_dist runs in one process; this process group has {dist.get_world_size()} ranks "
                           "(call it before init_process_group, or from a 1-rank group)")
    try:
        model = TPQwen3ForCausalLM.from_pretrained(hf_dir, single_process_groups(), dtype=dtype)
        # the file layout does not depend on train.grad_sync (both optimizers write rlrepro's layout: whole float32
        # masters, no moments at step 0), and megatron-core's optimizer needs its parallel_state, which this
        # one-process writer does not set up: the order-fixed path writes it
        config = dataclasses.replace(train_config, kl_coef=0.0, grad_sync="ordered")
        trainer = MegatronTrainer(model, config, param_dtype=param_dtype)
        return save_dist_checkpoint(trainer, ckpt_root, step, extra_state=extra_state)
    finally:
        if own_group:
            dist.destroy_process_group()

"""Saving and loading the megatron-dist checkpoint layout of :mod:`.dist_checkpoint` (see its docstring):
every rank writes and reads only its own shards through megatron-core's ``dist_checkpointing``.

Split from :mod:`.dist_checkpoint` so that :mod:`.trainer` can use it while the converters there (``hf_to_dist``
builds a ``MegatronTrainer``) import the trainer: no import circle. Import the public names from
:mod:`.dist_checkpoint` or :mod:`rlrepro.trainer.megatron`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from rlrepro._files import fsync_path

from .. import checkpoint as ckpt
from ..checkpoint import capture_rng_state, check_rng_state, checkpoint_dir_name, load_pt, restore_rng_state
from .mcore import cuda_calls_on_cpu, merged_over

__all__ = ["LAYOUT", "DIST_DIR", "META", "is_dist_checkpoint", "read_dist_meta", "save_dist_checkpoint",
           "load_dist_checkpoint"]

LAYOUT = "megatron-dist"
DIST_DIR = "dist"
META = "dist_meta.json"


# ------------------------------------------------------------------------------------------------------- helpers

def is_dist_checkpoint(path) -> bool:
    """Whether ``path`` (a ``step_NNNNNN`` directory) holds a manifest of the megatron-dist layout."""
    m = Path(path) / ckpt.MANIFEST
    try:
        return json.loads(m.read_text()).get("layout") == LAYOUT
    except (OSError, ValueError, AttributeError):
        return False


def read_dist_meta(path) -> dict:
    path = Path(path)
    if not is_dist_checkpoint(path):
        raise ValueError(f"{path} is not a megatron-dist checkpoint (its manifest.json has no \"layout\": "
                         f"\"{LAYOUT}\"); a full rlrepro checkpoint loads with Trainer/MegatronTrainer.load_checkpoint")
    return json.loads((path / META).read_text())


def _require_dist(what: str) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{what} with checkpoint_format='dist' needs torch.distributed initialised on every rank "
                           "(megatron-core's dist_checkpointing is collective; a 1-rank gloo group is enough), "
                           "or use checkpoint_format='full'")
    try:
        import megatron.core.dist_checkpointing  # noqa: F401
    except ImportError as e:
        raise ImportError(f"checkpoint_format='dist' needs megatron-core ({e}); install rlrepro[megatron] "
                          "(and psutil, which its checkpoint writer imports), or use checkpoint_format='full'") from e
    return dist.get_rank(), dist.get_world_size()


def _agree(error: BaseException | None, what: str) -> None:
    """Collective: raise on every rank if any rank failed (so no rank waits in a later collective)."""
    world = dist.get_world_size()
    errors: list = [None] * world
    dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    for r, e in enumerate(errors):
        if e is not None:
            raise RuntimeError(f"{what} failed on rank {r}: {e}")


def _full_shape(name: str, local: torch.Tensor, tp: int) -> list[int]:
    from .model import shard_spec

    dim, _ = shard_spec(name)
    shape = list(local.shape)
    if dim is not None and local.dim() > dim:
        shape[dim] *= tp
    return shape


def _entries(trainer) -> list[tuple[str, dict, torch.Tensor]]:
    """``(key, info, local tensor)`` of every tensor this rank's part of the dist checkpoint holds, key order.
    ``info``: kind (model | master | state), parameter name, state key, full shape, dtype, and ``dp_owned`` for
    optimizer tensors that live on one data-parallel rank only (``distributed_optimizer``: rlrepro's ZeRO-1, whose
    owner holds the whole TP shard's master and moments; the other DP ranks list none of them)."""
    opt, tp = trainer.optimizer, trainer.groups.tp_size
    owned = trainer.distributed_optimizer
    out = []
    for name, p in sorted(trainer.model.named_parameters(), key=lambda kv: kv[0]):
        out.append((f"model.{name}", dict(kind="model", name=name), p.detach()))
    if _megatron_core_optimizer(trainer):  # whole tensors gathered from the ranges onto their owner (a collective)
        tensors = opt.owned_tensors()
    else:  # None: a parameter another DP rank owns (ZeRO-1)
        tensors = [(n, "master", m.detach()) for n, m, p in zip(opt.names, opt.masters, opt.params)
                   if m is not None and m is not p]
        tensors += [(n, k, v.detach()) for n, m in zip(opt.names, opt.masters) if m is not None
                    for k, v in sorted(opt.inner.state.get(m, {}).items()) if torch.is_tensor(v) and v.dim() > 0]
    for name, k, t in tensors:
        kind = dict(kind="master") if k == "master" else dict(kind="state", state_key=k)
        out.append((f"optimizer.{k}.{name}", dict(kind, name=name, dp_owned=owned), t))
    for key, info, t in out:
        info.update(shape=_full_shape(info["name"], t, tp), dtype=str(t.dtype).replace("torch.", ""))
    return sorted(out, key=lambda e: e[0])


def _megatron_core_optimizer(trainer) -> bool:
    """Whether the trainer steps with megatron-core's optimizer (``grad_sync='megatron'``, :mod:`.mcore`)."""
    return getattr(trainer, "grad_sync", "ordered") == "megatron"


def _all_infos(trainer, entries) -> dict[str, dict]:
    """Every rank's tensor infos (key -> info): with the distributed optimizer the DP ranks' owned optimizer
    tensors, gathered (a collective over the DP group); else this rank's."""
    infos = {key: info for key, info, _ in entries}
    if trainer.distributed_optimizer:
        infos = merged_over(trainer.groups.dp_group, trainer.groups.dp_size, infos)
    return dict(sorted(infos.items()))


def _sharded_tensor(key: str, info: dict, data: torch.Tensor, groups):
    """This rank's piece of ``key`` as a megatron ShardedTensor: split along the parameter's TP dim (one main
    replica per shard: DP rank 0, or the DP owner for ``dp_owned`` optimizer tensors) or replicated over TP (main
    replica: TP rank 0 of that DP rank)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    from .model import shard_spec

    dp_replica = info.get("dp_replica", 0 if info.get("dp_owned") else groups.dp_rank)
    dim, _ = shard_spec(info["name"])
    if dim is not None and groups.tp_size > 1:
        return ShardedTensor.from_rank_offsets(key, data, (dim, groups.tp_rank, groups.tp_size),
                                               replica_id=(0, dp_replica))
    return ShardedTensor.from_rank_offsets(key, data, replica_id=(groups.tp_rank, dp_replica))


def _dist_file_writer(name: str) -> int:
    """The global rank that wrote ``name`` in megatron-core's checkpoint folder: torch_dist names each rank's data
    files ``__<rank>_<n>.distcp``; everything else (``.metadata``, ``metadata.json``, ``common.pt``) rank 0 writes."""
    m = re.match(r"__(\d+)_", name)
    return int(m.group(1)) if m else 0


def _fsync_own_dist_files(folder: Path, rank: int) -> None:
    """fsync every file this rank wrote under megatron-core's checkpoint folder, before the hashes, the manifest and
    the rename: megatron-core writes ``common.pt`` and ``metadata.json`` without an fsync (0.16.1), and its data
    files are synced in its writer processes, not by the rank that answers for them."""
    for f in sorted(folder.rglob("*")):
        if f.is_file() and _dist_file_writer(f.name) == rank:
            fsync_path(f)


def _write_torch(path: Path, obj) -> dict:
    return ckpt._write_file(path, lambda p: torch.save(obj, p))


# -------------------------------------------------------------------------------------------------------- saving

def save_dist_checkpoint(trainer, ckpt_root, step: int, *, extra_state: Mapping | None = None,
                         keep_last: int | None = None, generators: Mapping | None = None) -> Path:
    """Write ``ckpt_root/step_NNNNNN/`` (megatron-dist layout, see the module doc); a collective over the default
    process group (every rank of every TP group and DP replica). Returns the path on every rank."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    rank, world = _require_dist("save_checkpoint")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    root = Path(ckpt_root)
    final = root / checkpoint_dir_name(step)
    pid = [os.getpid()]
    dist.broadcast_object_list(pid, src=0)
    tmp = root / f"{final.name}.tmp-{pid[0]}"
    error = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / DIST_DIR).mkdir(parents=True)
            (tmp / "rng").mkdir()
        except BaseException as e:
            error = e
    _agree(error, "creating the checkpoint's temporary directory")
    try:
        try:
            entries = _entries(trainer)
            infos = _all_infos(trainer, entries)
            scalars = _all_scalars(trainer)
            sharded = {key: _sharded_tensor(key, info, t, trainer.groups) for key, info, t in entries}
            with cuda_calls_on_cpu(trainer.model.device):
                dc.save(sharded, str(tmp / DIST_DIR), sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1),
                        validate_access_integrity=True)
            _fsync_own_dist_files(tmp / DIST_DIR, rank)
            _write_torch(tmp / "rng" / f"rank_{rank:05d}.pt", capture_rng_state(generators))
            if rank == 0:
                _write_rank0_files(trainer, tmp, infos, scalars, step, extra_state, world)
        except BaseException as e:
            error = e
        _agree(error, "writing the dist checkpoint")
        # hash every file, split over the ranks (file i by rank i % world), then rank 0 writes the manifest
        files = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
        mine = {}
        try:
            for i, name in enumerate(files):
                if i % world == rank:
                    mine[name] = ckpt._file_digest(tmp / name)
        except BaseException as e:
            error = e
        _agree(error, "hashing the dist checkpoint")
        digests: list = [None] * world
        dist.all_gather_object(digests, mine)
        if rank == 0:
            try:
                listed = {k: v for d in digests for k, v in d.items()}
                manifest = {"format": ckpt.FORMAT, "version": ckpt.VERSION, "step": step, "layout": LAYOUT,
                            "files": dict(sorted(listed.items()))}
                for d in (tmp / DIST_DIR, tmp / "rng"):
                    ckpt._fsync_dir(d)
                ckpt._write_file(tmp / ckpt.MANIFEST,
                                 lambda p: p.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n"))
                ckpt._fsync_dir(tmp)
                ckpt.commit_checkpoint_dir(tmp, final)
            except BaseException as e:
                error = e
        _agree(error, "committing the dist checkpoint")
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last is not None and rank == 0:
        for old in ckpt._complete_steps(root)[keep_last:]:
            shutil.rmtree(root / checkpoint_dir_name(old), ignore_errors=True)
    dist.barrier()
    return final


def _all_scalars(trainer) -> dict[str, dict]:
    """Each parameter's non-tensor AdamW state (its step count), name -> dict; with the distributed optimizer
    gathered from the DP owners (a collective over the DP group)."""
    opt = trainer.optimizer
    if _megatron_core_optimizer(trainer):
        return opt.step_counts()
    names = opt.owned_names() if trainer.distributed_optimizer else opt.names  # AdamW's index j -> its parameter
    scalars = {names[j]: {k: v for k, v in per.items() if not (torch.is_tensor(v) and v.dim() > 0)}
               for j, per in opt.inner.state_dict()["state"].items()}
    if trainer.distributed_optimizer:
        scalars = merged_over(trainer.groups.dp_group, trainer.groups.dp_size, scalars)
    return dict(sorted(scalars.items()))


def _write_rank0_files(trainer, tmp: Path, infos: dict, scalars: dict, step: int, extra_state, world: int) -> None:
    g = trainer.groups
    opt = trainer.optimizer
    if _megatron_core_optimizer(trainer):
        groups = opt.adamw_param_groups()
    else:
        groups = [{k: v for k, v in group.items() if k != "params"}
                  for group in opt.inner.state_dict()["param_groups"]]
        for group in groups:  # the unsharded optimizer's one group over every parameter (also under ZeRO-1)
            group["params"] = list(range(len(opt.names)))
    _write_torch(tmp / "optimizer.pt", {"names": list(opt.names), "param_groups": groups, "scalars": scalars})
    _write_torch(tmp / "scheduler.pt", trainer.scheduler.state_dict())
    _write_torch(tmp / "extra_state.pt", dict(extra_state or {}))
    meta = {"step": step, "tensor_parallel": g.tp_size, "data_parallel": g.dp_size, "world_size": world,
            "model_config": trainer.model.config.to_dict(),
            "tensors": {key: {k: v for k, v in info.items() if k != "dp_owned"} for key, info in infos.items()}}
    ckpt._write_file(tmp / META, lambda p: p.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n"))


# ------------------------------------------------------------------------------------------------------- loading

def _check_compatible(trainer, meta: dict, path: Path) -> None:
    """The loading trainer must hold the same tensors (names, full shapes, dtypes, master copies) as the saved one;
    TP and DP may differ."""
    if _megatron_core_optimizer(trainer):  # model tensors and a float32 master for every non-float32 parameter
        own = {}
        for name, p in trainer.model.named_parameters():
            info = dict(shape=_full_shape(name, p, trainer.groups.tp_size), name=name)
            own[f"model.{name}"] = dict(info, kind="model", dtype=str(p.dtype).replace("torch.", ""))
            if p.dtype != torch.float32:
                own[f"optimizer.master.{name}"] = dict(info, kind="master", dtype="float32")
    else:
        own = {key: info for key, info in _all_infos(trainer, _entries(trainer)).items() if info["kind"] != "state"}
    saved = {key: info for key, info in meta["tensors"].items() if info["kind"] != "state"}
    own_model = {k for k, i in own.items() if i["kind"] == "model"}
    saved_model = {k for k, i in saved.items() if i["kind"] == "model"}
    if own_model != saved_model:
        raise ValueError(f"dist checkpoint {path} holds parameters {sorted(saved_model - own_model)[:5]} this model "
                         f"lacks and lacks {sorted(own_model - saved_model)[:5]}; load it into the same architecture "
                         f"(the saving run's config is in {path / META})")
    for key in sorted(own_model):
        a, b = own[key], saved[key]
        if a["shape"] != b["shape"]:
            cfg = meta.get("model_config", {})
            mine = trainer.model.config.to_dict()
            differ = {k: (cfg.get(k), mine.get(k)) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                             "num_hidden_layers", "num_attention_heads",
                                                             "num_key_value_heads", "head_dim")
                      if cfg.get(k) != mine.get(k)}
            raise ValueError(f"dist checkpoint {path}: {key[len('model.'):]!r} has full shape {tuple(b['shape'])}, "
                             f"this model's is {tuple(a['shape'])} (config saved vs this model: {differ}); the "
                             f"checkpoint is of another model shape: build the model from the saving run's config")
        if a["dtype"] != b["dtype"]:
            raise ValueError(f"dist checkpoint {path}: {key[len('model.'):]!r} is {b['dtype']}, this model's is "
                             f"{a['dtype']}; build the model with the saving run's dtype (and param_dtype)")
    own_m = {k for k, i in own.items() if i["kind"] == "master"}
    saved_m = {k for k, i in saved.items() if i["kind"] == "master"}
    if own_m != saved_m:
        raise ValueError(f"dist checkpoint {path} holds float32 master weights for {len(saved_m)} parameters, this "
                         f"trainer keeps {len(own_m)} separate masters; use the same param_dtype as the saving run")


def _verify_collectively(path: Path, rank: int) -> dict:
    """Rank 0 checks every file's sha256, the others sizes; all agree before any rank reads tensors."""
    manifest, error = None, None
    try:
        manifest = ckpt.verify_checkpoint(path, check_hashes=(rank == 0))
        if manifest.get("layout") != LAYOUT:
            raise ValueError(f"{path} is not a megatron-dist checkpoint")
    except BaseException as e:
        error = e
    _agree(error, f"verifying {path}")
    return manifest


def _read_optimizer_state(trainer, path: Path, targets: dict, loaded: dict, owned, mcore: bool) -> tuple[dict, dict]:
    """From what ``dc.load`` read (``loaded``) and ``optimizer.pt``: this rank's weights (name -> tensor, not yet
    copied into the model) and its optimizer state in rlrepro's unsharded layout; changes nothing live."""
    opt = trainer.optimizer
    common = load_pt(path / "optimizer.pt")
    if not isinstance(common, Mapping) or not {"names", "param_groups", "scalars"} <= set(common):
        raise ValueError(f"dist checkpoint {path}: optimizer.pt is not rlrepro's (it needs 'names', 'param_groups' "
                         "and 'scalars'); resume from another checkpoint")
    if list(common["names"]) != list(opt.names):
        raise ValueError(f"dist checkpoint {path} holds optimizer state for other parameters; load it into a "
                         "trainer built for the same model")
    index = {n: i for i, n in enumerate(opt.names)}
    weights, state, masters = {}, {}, {}
    for key, (info, _) in targets.items():
        t = loaded[key]
        if info["kind"] == "model":
            weights[info["name"]] = t
        elif info["kind"] == "master":
            masters[info["name"]] = t
        else:
            state.setdefault(index[info["name"]], {})[info["state_key"]] = t
    scalars = common["scalars"]
    unknown = sorted(set(scalars) - set(index)) if isinstance(scalars, Mapping) else ["(not a mapping)"]
    if unknown:
        raise ValueError(f"dist checkpoint {path}: optimizer.pt holds AdamW step counts for {unknown[:5]}, not "
                         "parameters of this model; resume from another checkpoint")
    for name, per in scalars.items():
        state.setdefault(index[name], {}).update(per)
    if owned is not None and not mcore:  # others' masters: not read (ShardedMasterWeightAdamW keeps its own only)
        masters.update({n: None for n in opt.names if n not in owned})
    return weights, {"names": list(opt.names), "adamw": {"state": state, "param_groups": common["param_groups"]},
                     "master_weights": masters}


def load_dist_checkpoint(trainer, path, *, generators: Mapping | None = None, restore_rng: bool = True) -> dict:
    """Verify ``path`` (megatron-dist layout), check it holds this trainer's model, and load this rank's shards of
    weights, masters and AdamW moments (resharded when the saving TP differs), the schedule and the RNG states:
    each rank its own when the world size is the saving run's, else rank 0's on every rank (as a full checkpoint
    does). A collective. Returns ``extra_state``.

    All or nothing, as :func:`rlrepro.trainer.checkpoint.load_checkpoint`: every rank reads its shards into new
    tensors and runs every check (weights, the optimizer's ``prepare_state_dict``, the schedule, the RNG states), and
    the ranks agree, before any rank changes its weights, optimizer, schedule or RNGs; a refusal raises on every rank
    (the ValueError names the mismatch and the fix) and leaves every trainer as it was."""
    from megatron.core import dist_checkpointing as dc

    rank, world = _require_dist("load_checkpoint")
    path = Path(path)
    _verify_collectively(path, rank)
    meta = json.loads((path / META).read_text())
    _check_compatible(trainer, meta, path)

    opt, g = trainer.optimizer, trainer.groups
    params = dict(trainer.model.named_parameters())
    local_shape = {n: tuple(p.shape) for n, p in params.items()}
    mcore = _megatron_core_optimizer(trainer)
    # which parameters' optimizer tensors this rank reads: rlrepro's ZeRO-1 those it owns; megatron-core's
    # distributed optimizer those it holds a range of (whole tensors into CPU memory, then its ranges kept)
    first_reader = {}  # megatron-core: a tensor may be read by several DP ranks; the lowest is its main replica
    if not trainer.distributed_optimizer:
        owned = None
    elif mcore:
        owned = set(opt.names_with_ranges())
        readers = [None] * g.dp_size
        dist.all_gather_object(readers, sorted(owned), group=g.dp_group)
        for r, names in enumerate(readers):
            for n in names:
                first_reader.setdefault(n, r)
    else:
        owned = set(opt.owned_names())
    targets = {}
    for key, info in meta["tensors"].items():
        if owned is not None and info["kind"] != "model" and info["name"] not in owned:
            continue
        p = params[info["name"]]
        device = "cpu" if mcore and info["kind"] != "model" else p.device
        t = torch.empty(local_shape[info["name"]], dtype=getattr(torch, info["dtype"]), device=device)
        info = dict(info, dp_owned=owned is not None and info["kind"] != "model")
        if info["name"] in first_reader and info["kind"] != "model":
            info["dp_replica"] = 0 if first_reader[info["name"]] == g.dp_rank else g.dp_rank
        targets[key] = (info, t)
    sharded = {key: _sharded_tensor(key, info, t, g) for key, (info, t) in targets.items()}
    with cuda_calls_on_cpu(trainer.model.device):
        loaded = dc.load(sharded, str(path / DIST_DIR))

    # 1. read and check everything on every rank (all agree before any rank changes anything live)
    error = weights = optim_state = sched_state = extra_state = rng_state = None
    try:
        weights, optim_state = _read_optimizer_state(trainer, path, targets, loaded, owned, mcore)
        if hasattr(opt, "prepare_state_dict"):
            optim_state = opt.prepare_state_dict(optim_state)
        sched_state = load_pt(path / "scheduler.pt")
        if hasattr(trainer.scheduler, "check_state_dict"):
            trainer.scheduler.check_state_dict(sched_state)
        extra_state = load_pt(path / "extra_state.pt")
        if restore_rng:
            own = path / "rng" / f"rank_{rank:05d}.pt"
            rng_state = load_pt(own if meta["world_size"] == world else path / "rng" / "rank_00000.pt")
            check_rng_state(rng_state, generators)
    except BaseException as e:
        error = e
    _agree(error, f"checking {path}")
    # 2. apply: in-place copies of checked shapes, a prepared optimizer state, plain values
    with ckpt.applying_checkpoint(path):
        with torch.no_grad():
            for name, t in weights.items():
                params[name].copy_(t)
        opt.load_state_dict(optim_state)
        trainer.scheduler.load_state_dict(sched_state)
        if restore_rng:
            restore_rng_state(rng_state, generators)
    dist.barrier()
    return extra_state


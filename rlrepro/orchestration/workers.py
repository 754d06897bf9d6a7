"""The two kinds of actor. Plain classes: ``ray.remote`` wraps them in :mod:`.driver`, and tests can also
use them in-process. Each fixes its own torch thread count, so CPU results do not depend on how many cores
Ray happens to give the process."""
from __future__ import annotations

import os

import torch


def _setup_process(device: str, torch_threads: int) -> None:
    torch.set_num_threads(torch_threads)
    stall_s = float(os.environ.get("RLREPRO_STACK_DUMP_S", "0") or 0)
    if stall_s > 0:  # debugging a hang: every thread's Python stack to the actor's stderr after this many seconds
        import faulthandler

        faulthandler.dump_traceback_later(stall_s, repeat=True)
    if device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class RolloutWorker:
    """One engine. ``generate`` takes keyed requests and returns keyed results; the key never influences the
    numbers (the sampling seed inside the request does)."""

    def __init__(self, model_dir: str, *, device: str, dtype: str | None, deterministic: bool,
                 engine_kwargs: dict, torch_threads: int = 1, tensor_parallel_emulation: int = 1) -> None:
        _setup_process(device, torch_threads)
        from rlrepro.rollout import Engine

        engine_kwargs = dict(engine_kwargs)
        fraction = engine_kwargs.pop("gpu_memory_fraction", None)
        if device == "cuda" and engine_kwargs.get("num_kv_blocks") is None and fraction:
            engine_kwargs["kv_cache_memory_bytes"] = int(fraction * torch.cuda.get_device_properties(0).total_memory)
        model = model_dir
        if tensor_parallel_emulation > 1:
            # the trainer is sharded over TP ranks (trainer.backend=megatron): compute its reduction order here,
            # before the engine captures its CUDA graphs
            from rlrepro.model import load_pretrained

            model = load_pretrained(model_dir, device=device, dtype=_dtype(dtype))
            model.set_tensor_parallel_emulation(tensor_parallel_emulation)
        self.engine = Engine(model, device=device, dtype=_dtype(dtype), deterministic=deterministic,
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

    def load_weights_ipc(self, handles: list, version: int) -> int:
        """CUDA IPC: map the trainer's parameters (same GPU) and copy them device to device."""
        from .weight_sync import open_ipc_handles

        self.engine.load_weights(open_ipc_handles(handles), version=version)
        torch.cuda.current_stream().synchronize()  # done reading before the trainer may write again
        return version

    def sync_group_join(self, host: str, port: int, rank: int, world_size: int, backend: str,
                        generation: int) -> bool:
        from .weight_sync import WeightBroadcaster

        if getattr(self, "_sync", None) is not None:
            self._sync.close()
        self._sync = WeightBroadcaster(host, port, rank, world_size, backend=backend, generation=generation)
        return True

    def sync_receive(self) -> int:
        """Receive a collective broadcast straight into the engine's parameters."""
        version = self._sync.receive(dict(self.engine.model.named_parameters()))
        self.engine.load_weights((), version=version)  # nothing to copy: sets the version, drops the prefix cache
        return version

    def memory_stats(self) -> dict:
        return _memory_stats()

    def weight_version(self) -> int:
        return self.engine.weight_version

    def pid(self) -> int:
        return os.getpid()


class TrainerWorker:
    """The policy, its optimizer and its checkpoints."""

    def __init__(self, model_dir: str, *, device: str, dtype: str | None, deterministic: bool,
                 train_kwargs: dict, torch_threads: int = 1, rank: int = 0, world_size: int = 1,
                 backend: str = "default", tensor_parallel: int = 1, checkpoint_format: str = "full",
                 distributed_optimizer: bool = False, grad_sync: str = "ordered") -> None:
        _setup_process(device, torch_threads)
        # shard the optimizer state over the data-parallel ranks (train.num_gpus > 1; a no-op with one rank)
        self.distributed_optimizer = distributed_optimizer
        self.device, self.rank, self.world_size = device, rank, world_size
        self.model_dir, self.dtype_name = model_dir, dtype
        self.backend, self.tensor_parallel, self.checkpoint_format = backend, tensor_parallel, checkpoint_format
        self.grad_sync = grad_sync
        self.data_parallel = None
        self._sync = self._rendezvous = None
        self._full_weights: list | None = None  # megatron: the gathered weights of the current step (rank 0)
        from rlrepro import kernels
        from rlrepro.model import load_pretrained
        from rlrepro.trainer import Trainer, TrainConfig, enable_determinism

        enable_determinism()
        self.kernel_mode = "deterministic" if deterministic else "fast"
        self.train_config = TrainConfig(**train_kwargs)
        self._kernels = kernels
        self.model = self.ref_model = self.trainer = None
        if backend == "megatron":
            return  # built by init_data_parallel, once the ranks' group exists
        self.model = load_pretrained(model_dir, device=device, dtype=_dtype(dtype))
        # The KL reference is the policy RL starts from: the loaded weights, or the warm-started ones.
        self.ref_model = self._frozen_copy() if self.train_config.kl_coef > 0 else None
        self.trainer = Trainer(self.model, self.train_config, ref_model=self.ref_model)

    # ---------------------------------------------------------------------------- data parallel (train.num_gpus)
    def rendezvous_address(self) -> tuple[str, int]:
        """Open a listening socket on this node (kept until the next group is built on it) for a group this
        actor hosts as rank 0; returns its (host, port)."""
        from .weight_sync import Rendezvous

        self._rendezvous = Rendezvous(_node_address())
        return self._rendezvous.host, self._rendezvous.port

    def init_data_parallel(self, host: str, port: int) -> int:
        """Join the trainer ranks' group (NCCL on CUDA, gloo on CPU); the update becomes data parallel with
        the order-fixed gradient sum of :class:`rlrepro.trainer.DataParallel`. Returns this rank."""
        import datetime

        import torch.distributed as dist

        from rlrepro.trainer import DataParallel, Trainer

        backend = "nccl" if self.device == "cuda" else "gloo"
        if backend == "nccl":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            torch.cuda.set_device(0)  # Ray gives each trainer rank its own GPU, visible as device 0
        from .weight_sync import tcp_store

        timeout = datetime.timedelta(seconds=600)
        rdv = self._rendezvous if self.rank == 0 else None
        store = tcp_store(host, port, self.world_size, rdv, timeout)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        self._rendezvous = None
        if self.backend == "megatron":
            from rlrepro.trainer.megatron import build_megatron_trainer

            self.trainer = build_megatron_trainer(self.model_dir, self.train_config,
                                                  tensor_parallel=self.tensor_parallel, num_gpus=self.world_size,
                                                  device=self.device, dtype=_dtype(self.dtype_name),
                                                  checkpoint_format=self.checkpoint_format,
                                                  distributed_optimizer=self.distributed_optimizer,
                                                  grad_sync=self.grad_sync)
            self.model = self.trainer.model
            self._gather_weights()
            return self.rank
        self.data_parallel = DataParallel()
        self.trainer = Trainer(self.model, self.train_config, ref_model=self.ref_model,
                               data_parallel=self.data_parallel, distributed_optimizer=self.distributed_optimizer)
        return self.rank

    def _gather_weights(self) -> None:
        """megatron: gather the full weights on every rank (a collective) and keep them until the next update, so
        that the weight sync, digest and get_weights calls of this step run on one rank alone: rank 0 for the
        object store and the broadcast, each engine's own GPU's rank for CUDA IPC (NCCL cannot put two ranks of
        one communicator on one GPU, so colocated engines are not fed by a broadcast). Costs one unsharded copy
        of the weights (compute dtype) per rank."""
        if self.backend != "megatron":
            return
        self._full_weights = None
        self._full_weights = [(n, t.detach().clone()) for n, t in self.trainer.named_weights()]

    def _weights(self):
        """The policy's (name, tensor) pairs in name order, unsharded, in the compute dtype."""
        if self.backend == "megatron":
            return iter(self._full_weights)
        return self.trainer.named_weights()

    def train_step(self, samples: list[dict]) -> dict:
        with self._kernels.mode(self.kernel_mode):
            metrics = self.trainer.train_step(samples)
        self._gather_weights()
        metrics["perf/train_flops"] = train_flops(self.model.config, samples, self.train_config)
        if self.device == "cuda":
            name = torch.cuda.get_device_name()
            metrics["perf/gpu_peak_flops"] = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
        return metrics

    def warm_start(self, examples: list[tuple[list[int], list[int]]], *, steps: int, lr: float, batch_size: int,
                   seed: int) -> list[float]:
        from .warm_start import supervised_warm_start

        from rlrepro.trainer import Trainer

        with self._kernels.mode(self.kernel_mode):
            losses = supervised_warm_start(self.model, examples, steps=steps, lr=lr, batch_size=batch_size, seed=seed)
        if self.ref_model is not None:
            self.ref_model = self._frozen_copy()
        self.trainer = Trainer(self.model, self.train_config, ref_model=self.ref_model,
                               data_parallel=self.data_parallel,
                               distributed_optimizer=self.distributed_optimizer)  # fresh optimizer state
        return losses

    def _frozen_copy(self):
        import copy

        ref = copy.deepcopy(self.model)
        ref.requires_grad_(False)
        return ref.eval()

    def get_weights(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().to("cpu", copy=True) for name, t in self._weights()}

    def ipc_handles(self) -> list:
        """CUDA IPC handles of the policy's parameters, for an engine on the same GPU."""
        from .weight_sync import ipc_handles

        return ipc_handles(self._weights())

    def sync_group_join(self, host: str, port: int, world_size: int, backend: str, generation: int) -> bool:
        """Host (as rank 0) a new weight-sync group with the rollout workers; an older one is closed."""
        from .weight_sync import WeightBroadcaster

        if self._sync is not None:
            self._sync.close()
        self._sync = WeightBroadcaster(host, port, 0, world_size, backend=backend, generation=generation,
                                       rendezvous=self._rendezvous)
        self._rendezvous = None
        return True

    def sync_send(self, version: int) -> int:
        self._sync.send(self._weights(), version)
        return version

    def memory_stats(self) -> dict:
        return _memory_stats()

    def weights_digest(self) -> str:
        from rlrepro.repro.fingerprint import weights_digest

        return weights_digest(self._weights())

    def save_checkpoint(self, ckpt_root: str, step: int, extra_state: dict, keep_last: int) -> str:
        # with distributed_optimizer a collective: every trainer rank must be called (rank 0 writes)
        return str(self.trainer.save_checkpoint(ckpt_root, step, extra_state=extra_state, keep_last=keep_last))

    def load_checkpoint(self, path: str) -> dict:
        extra = self.trainer.load_checkpoint(path)
        self._gather_weights()
        return extra

    def export_hf(self, path: str) -> str:
        from rlrepro.trainer import export_hf

        if self.backend == "megatron":
            return str(self.trainer.export_hf(path))  # a collective: every rank calls it
        return str(export_hf(self.model, path))


# bf16 dense tensor-core peak (FLOP/s) by GPU name, for MFU; GPUs not listed get no MFU
PEAK_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}


def _node_address() -> str:
    """This node's address as Ray knows it (127.0.0.1 in local mode); 127.0.0.1 outside Ray."""
    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    except Exception:  # noqa: BLE001 - outside Ray (in-process tests)
        return "127.0.0.1"


def _memory_stats() -> dict:
    """Peak GPU memory since the last call (GiB), then the peak is reset; {} on CPU."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    stats = {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
             "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    torch.cuda.reset_peak_memory_stats()
    return stats


def train_flops(config, samples: list[dict], train_config) -> float:
    """Model FLOPs of one train step on ``samples`` (all ranks together): a forward pass for the KL reference when
    kl_coef > 0, and forward + backward (3 forwards) per PPO epoch (the on-policy check reuses the first epoch's
    forward). A forward costs
    2 FLOPs per matmul weight per token for the layers' linears (the embedding lookup is free), 2 per lm_head
    weight for each completion token only (the trainer computes logits where a completion token is predicted, not
    at prompt positions), plus causal attention, 2 * 2 * layers * heads * head_dim * (i + 1) for the token at
    position i."""
    h, L = config.hidden_size, config.num_hidden_layers
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    fwd = 0.0
    for s in samples:
        c = len(s["completion_token_ids"])
        n = len(s["prompt_token_ids"]) + c
        fwd += 2.0 * L * per_layer * n + 2.0 * h * config.vocab_size * c + 4.0 * L * q * n * (n + 1) / 2
    passes = (1 if train_config.kl_coef > 0 else 0) + 3 * train_config.ppo_epochs
    return fwd * passes

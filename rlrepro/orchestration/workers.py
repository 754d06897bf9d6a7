"""The two kinds of actor, and the typed request that travels to a rollout worker.

Plain classes: :class:`~.actors.ActorGroup` wraps them with ``ray.remote``, and tests can also use them
in-process. Each fixes its own torch thread count, so CPU results do not depend on how many cores Ray happens to
give the process. A rollout worker takes :class:`Request` objects (the key, the prompt and its SamplingParams) and
returns the engine's ``RequestOutput`` objects in the same order (or runs multi-turn episodes,
:meth:`RolloutWorker.run_episodes`); a trainer rank takes :class:`rlrepro.samples.Sample`
objects.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rlrepro.envs import EnvConfig
    from rlrepro.rollout import EngineConfig, RequestOutput, SamplingParams
    from rlrepro.samples import Sample
    from rlrepro.trainer import TrainConfig

    from .episodes import EpisodeRequest, EpisodeResult


@dataclass(frozen=True)
class Request:
    """One sampling request: ``key`` = (prompt uid, sample index) never influences the numbers; the seed inside
    ``params`` does."""
    key: tuple[str, int]
    prompt_token_ids: list[int]
    params: "SamplingParams"


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

    def __init__(self, model_dir: str, engine_config: "EngineConfig", *, device: str, dtype: str | None,
                 deterministic: bool, seed: int, torch_threads: int = 1, tensor_parallel_emulation: int = 1) -> None:
        _setup_process(device, torch_threads)
        from rlrepro.rollout import Engine

        model = model_dir
        if tensor_parallel_emulation > 1:
            # the trainer is sharded over TP ranks (trainer.backend=megatron): compute its reduction order here,
            # before the engine captures its CUDA graphs
            from rlrepro.model import load_pretrained

            model = load_pretrained(model_dir, device=device, dtype=_dtype(dtype))
            model.set_tensor_parallel_emulation(tensor_parallel_emulation)
        self.engine = Engine.from_config(model, engine_config, device=device, dtype=_dtype(dtype),
                                         deterministic=deterministic, seed=seed)
        self.model_dir = model_dir
        self._weights_broken: str | None = None  # why the weights are a mix of two versions (a failed update)
        self._tokenizer = None
        self._env_specs: dict = {}  # (env config, reward.fn) -> EnvSpec, built once

    def generate(self, requests: list[Request]) -> list["RequestOutput"]:
        """The engine's outputs, one per request, in the order of ``requests``."""
        self._check_weights_whole()
        if not requests:
            return []
        return self.engine.generate([r.prompt_token_ids for r in requests], [r.params for r in requests])

    def run_episodes(self, requests: list["EpisodeRequest"], env_config: "EnvConfig", reward_fn_spec: str,
                     max_tokens: int | None = None, use_chat_template: bool = True,
                     tool_threads: int = 2, reward_on_error: str = "raise",
                     import_dirs: list[str] | None = None,
                     end_of_turn: str | None = None) -> list["EpisodeResult"]:
        """Multi-turn episodes on this engine (:func:`.episodes.run_episodes`), results in key order. The
        environment (``env_config`` with the reward ``reward_fn_spec``, loaded as the driver loads ``reward.fn``)
        and the tokenizer of the model directory are built on the first call and kept. ``use_chat_template``:
        whether the prompts were rendered with the chat template (then observations are too, and a turn cut by
        length is closed with ``end_of_turn``, the template's end of turn: the driver's
        ``preflight.check_end_of_turn``; None: the tokenizer's EOS); ``max_tokens``: per turn (None: each
        request's own). The requests' stop ids hold the end-of-turn token's (``episodes.turn_stop_token_ids``)."""
        from .episodes import run_episodes

        self._check_weights_whole()
        if not requests:
            return []
        if self._tokenizer is None:
            from rlrepro.model import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_dir)
        key = (repr(env_config), reward_fn_spec, reward_on_error)
        if key not in self._env_specs:  # the reward with reward.on_error's checks and policy, as the driver's
            from .import_path import append_to_path

            append_to_path(import_dirs)  # where the driver found reward.fn's and env.fn's modules, last
            from rlrepro.data import load_reward_fn, reward_with_policy
            from rlrepro.envs import load_env

            reward = reward_with_policy(load_reward_fn(reward_fn_spec), reward_on_error)
            self._env_specs[key] = load_env(env_config, reward)
        end_of_turn = (end_of_turn or self._tokenizer.eos_token) if use_chat_template else None
        spec = self._env_specs[key]
        before = spec.reward_fn.errors()  # reward_with_policy's count
        results = run_episodes(self.engine, requests, spec, self._tokenizer, max_tokens=max_tokens,
                               end_of_turn=end_of_turn, tool_threads=tool_threads)
        # the rewards reward.on_error=zero made 0.0 in this call; the driver adds them up (rollout/reward_errors)
        results[0].metrics["reward_errors"] = spec.reward_fn.errors() - before
        return results

    # ------------------------------------------------------------------------------------ weight updates
    # An update is all or nothing for generation: a set of weights that does not match the engine's parameters
    # (names, shapes, dtypes) is refused before any tensor is copied, and an update that fails once copying began
    # leaves the weights a mix of two versions, so the worker refuses to generate until a complete update
    # succeeds (the driver replaces or reloads it; it never samples silently from mixed weights).
    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> int:
        """Load a complete set of the trainer's weights (object store); returns ``version``."""
        named = list(weights.items()) if hasattr(weights, "items") else list(weights)
        self._update(lambda: self.engine.load_weights(self._checked(named, version), version=version), version)
        return version

    def load_weights_ipc(self, handles: list, version: int) -> int:
        """CUDA IPC: map the trainer's parameters (same GPU) and copy them device to device."""
        from .weight_sync import open_ipc_handles

        named = list(open_ipc_handles(handles))
        self._update(lambda: self.engine.load_weights(self._checked(named, version), version=version), version)
        torch.cuda.current_stream().synchronize()  # done reading before the trainer may write again
        return version

    def _checked(self, named: list, version: int) -> list:
        """``named`` when it is exactly the engine's parameters (a tied ``lm_head.weight`` may come too when it is
        the embedding) with their shapes and dtypes (``Engine.check_weights``, the check the collective path's
        ``WeightBroadcaster._check`` makes too), and ``version`` is not older than the engine's; else
        :class:`~.weight_sync.WeightsRefused`, before any weight changed. A dtype cast would run weights other than
        the trainer's (its logprobs would no longer be the sampler's), a missing tensor would keep a stale one under
        the new version, and an older version would run a stale policy under a newer one's name."""
        from .weight_sync import WeightsRefused, version_problem

        problem = version_problem(version, self.engine.weight_version)
        if problem is None:
            try:
                named = self.engine.check_weights(named, complete=True)
            except ValueError as e:
                problem = f"{e} (every parameter must come, as the trainer holds it)"
        if problem is not None:
            raise WeightsRefused(f"weight sync to version {version}: {problem}")
        return named

    def _update(self, apply, version):
        """Run a weight update; one that raises after it may have written a weight marks the worker broken."""
        from .weight_sync import WeightsRefused

        try:
            out = apply()
        except WeightsRefused:  # refused before any tensor was written: the weights are still one version
            raise
        except BaseException as e:
            self._weights_broken = f"the update to version {version} failed part way ({type(e).__name__}: {e})"
            raise
        self._weights_broken = None
        return out

    def _check_weights_whole(self) -> None:
        if self._weights_broken is not None:
            raise RuntimeError(f"rollout worker refuses to generate: its weights are a mix of two versions, since "
                               f"{self._weights_broken[:400]}; a complete weight load (load_weights) restores it")

    def weights_digest(self) -> str:
        """``weights_digest`` of the engine's parameters: equal to the trainer's after a sync (bit for bit)."""
        from rlrepro.repro.fingerprint import weights_digest

        return weights_digest((n, p.detach()) for n, p in self.engine.model.named_parameters())

    def sync_group_join(self, host: str, port: int, rank: int, world_size: int, backend: str,
                        generation: int) -> bool:
        from .weight_sync import WeightBroadcaster

        if getattr(self, "_sync", None) is not None:
            self._sync.close()
        self._sync = WeightBroadcaster(host, port, rank, world_size, backend=backend, generation=generation)
        return True

    def sync_receive(self) -> int:
        """Receive a collective broadcast straight into the engine's parameters (``Engine.receive_weights``: the
        unfinished-requests guard, the version, the prefix cache dropped)."""
        self._sync.held_version = self.engine.weight_version  # an older broadcast is refused before any copy
        return self._update(lambda: self.engine.receive_weights(self._sync.receive), "the broadcast one")

    def memory_stats(self) -> dict:
        return _memory_stats()

    def pid(self) -> int:
        return os.getpid()


class TrainerWorker:
    """The policy, its optimizer and its checkpoints."""

    def __init__(self, model_dir: str, train_config: "TrainConfig", *, temperature: float,
                 max_response_length: int | None, device: str, dtype: str | None, deterministic: bool,
                 torch_threads: int = 1, rank: int = 0, world_size: int = 1, checkpoint_format: str = "full") -> None:
        _setup_process(device, torch_threads)
        self.device, self.rank, self.world_size = device, rank, world_size
        self.model_dir, self.dtype_name = model_dir, dtype
        self.backend, self.checkpoint_format = train_config.backend, checkpoint_format
        # the rollout's temperature and max_tokens: what the trainer's logprobs and length normalisation follow
        self.rollout_args = dict(temperature=temperature, max_response_length=max_response_length)
        self.data_parallel = None
        self._sync = self._rendezvous = None
        self._full_weights: list | None = None  # megatron: the gathered weights of the current step (rank 0)
        from rlrepro import kernels
        from rlrepro.model import load_pretrained
        from rlrepro.trainer import Trainer, enable_determinism

        enable_determinism()
        self.kernel_mode = "deterministic" if deterministic else "fast"
        self.train_config = train_config
        self._kernels = kernels
        self.model = self.ref_model = self.trainer = None
        if self.backend == "megatron":
            return  # built by init_data_parallel, once the ranks' group exists
        self.model = load_pretrained(model_dir, device=device, dtype=_dtype(dtype))
        # The KL reference is the policy RL starts from: the loaded weights, or the warm-started ones.
        self.ref_model = self._frozen_copy() if self.train_config.kl_coef > 0 else None
        self.trainer = Trainer(self.model, self.train_config, ref_model=self.ref_model, **self.rollout_args)

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
        from .network import pin_socket_interfaces
        from .weight_sync import tcp_store

        timeout = datetime.timedelta(seconds=float(self.train_config.collective_timeout_s))
        rdv = self._rendezvous if self.rank == 0 else None
        store = tcp_store(host, port, self.world_size, rdv, timeout)
        # gloo (and megatron's new_group calls) and NCCL listen on this node's address: loopback in local mode
        pin_socket_interfaces(_node_address())
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        self._rendezvous = None
        if self.backend == "megatron":
            from rlrepro.trainer.megatron import build_megatron_trainer

            self.trainer = build_megatron_trainer(self.model_dir, self.train_config, num_gpus=self.world_size,
                                                  device=self.device, dtype=_dtype(self.dtype_name),
                                                  checkpoint_format=self.checkpoint_format, **self.rollout_args)
            self.model = self.trainer.model
            self._gather_weights()
            return self.rank
        self.data_parallel = DataParallel()
        self.trainer = Trainer(self.model, self.train_config, ref_model=self.ref_model,
                               data_parallel=self.data_parallel, **self.rollout_args)
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

    def train_step(self, samples: list["Sample"], keep_previous: bool = False) -> dict:
        """One update. ``keep_previous``: keep a host copy of the weights from before it (and their version) for
        :meth:`weights_of_version`, until the next call (:meth:`_snapshot_weights`)."""
        from rlrepro.trainer.flops import peak_flops, train_flops

        self._previous = (self.trainer.step, self._snapshot_weights()) if keep_previous else None

        with self._kernels.mode(self.kernel_mode):
            metrics = self.trainer.train_step(samples)
        self._gather_weights()
        metrics["perf/train_flops"] = train_flops(self.model.config, samples, self.train_config)
        if self.device == "cuda":
            metrics["perf/gpu_peak_flops"] = peak_flops(torch.cuda.get_device_name())
        return metrics

    def warm_start(self, examples: list[tuple[list[int], list[int]]], *, steps: int, lr: float, batch_size: int,
                   seed: int) -> list[float]:
        from rlrepro.trainer import Trainer
        from rlrepro.trainer.warm_start import supervised_warm_start

        with self._kernels.mode(self.kernel_mode):
            losses = supervised_warm_start(self.model, examples, steps=steps, lr=lr, batch_size=batch_size, seed=seed)
        if self.ref_model is not None:
            self.ref_model = self._frozen_copy()
        self.trainer = Trainer(self.model, self.train_config, ref_model=self.ref_model,
                               data_parallel=self.data_parallel, **self.rollout_args)  # fresh optimizer state
        return losses

    def _frozen_copy(self):
        import copy

        ref = copy.deepcopy(self.model)
        ref.requires_grad_(False)
        return ref.eval()

    def get_weights(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().to("cpu", copy=True) for name, t in self._weights()}

    def _snapshot_weights(self) -> dict[str, torch.Tensor]:
        """The weights as they are now, kept through the coming update. megatron: the gathered copy of this step
        (the update does not write it). CUDA: device -> pinned host copies on a side stream, overlapped with the
        step's forward and backward passes, which only read the weights; the first optimizer update waits for
        them (``Trainer.before_update``). CPU: a copy."""
        if self.backend == "megatron":
            return dict(self._full_weights)
        if self.device != "cuda":
            return self.get_weights()
        named = [(n, t.detach()) for n, t in self._weights()]
        pinned = getattr(self, "_pinned", None)
        if pinned is None or [n for n, _ in named] != list(pinned):
            pinned = self._pinned = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for n, t in named}
        stream = getattr(self, "_copy_stream", None) or torch.cuda.Stream()
        self._copy_stream = stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for n, t in named:
                pinned[n].copy_(t, non_blocking=True)
        done = stream.record_event()
        trainer = self.trainer

        def wait() -> None:  # before the update may write the weights; once
            torch.cuda.current_stream().wait_event(done)
            trainer.before_update = None

        trainer.before_update = wait
        self._snapshot_done = done
        return pinned

    def weights_of_version(self, version: int) -> dict[str, torch.Tensor]:
        """The weights of ``version`` (the step after which they were current): the current ones, or those from
        before the last update when train_step kept them. Whatever order this call and a train_step run in, the
        answer is the same tensors, or an error; never another version's weights."""
        if self.trainer.step == version:
            return self.get_weights()
        previous = getattr(self, "_previous", None)
        if previous is not None and previous[0] == version:
            done = getattr(self, "_snapshot_done", None)
            if done is not None:
                done.synchronize()  # the host copies are complete
            return previous[1]  # serialized as the call returns (the pinned buffers are reused next step)
        held = [self.trainer.step] + ([previous[0]] if previous is not None else [])
        raise RuntimeError(f"the trainer holds the weights of version(s) {held}, not {version}")

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
        self._rendezvous = None  # a join that raised (aborted) keeps it, and the store it serves, until the next
        return True

    def sync_send(self, version: int) -> int:
        self._sync.send(self._weights(), version)
        return version

    def memory_stats(self) -> dict:
        return _memory_stats()

    def weights_digest(self) -> str:
        from rlrepro.repro.fingerprint import weights_digest

        return weights_digest(self._weights())

    def optimizer_state_digests(self) -> dict[str, str] | None:
        """``tensor_digest`` by name of the optimizer state this rank holds, beyond the compute-dtype weights that
        ``weights_digest`` covers: the float32 master weights kept as separate copies (``master/<param>``) and
        AdamW's state of each parameter (``adamw/<param>/<key>``: moments, step). With the optimizer sharded over
        data-parallel ranks (ZeRO-1) the tensors of the parameters this rank owns, so that the caller's merge of
        every rank's is the unsharded optimizer's (``optimizer_state_digest``). None for megatron, whose sharded
        optimizer is not fingerprinted."""
        from rlrepro.repro.fingerprint import tensor_digests

        if self.backend == "megatron":
            return None
        opt = self.trainer.optimizer
        named = []
        for name, master, param in zip(opt.names, opt.masters, opt.params):
            if master is None:  # owned by another data-parallel rank
                continue
            if master is not param:
                named.append((f"master/{name}", master.detach()))
            for key, value in sorted(opt.inner.state.get(master, {}).items()):
                t = value.detach() if torch.is_tensor(value) else torch.tensor(value, dtype=torch.float64)
                named.append((f"adamw/{name}/{key}", t))
        return dict(zip((n for n, _ in named), tensor_digests(t for _, t in named)))

    def save_checkpoint(self, ckpt_root: str, step: int, extra_state: dict, keep_last: int) -> str:
        # with distributed_optimizer a collective: every trainer rank must be called (rank 0 writes)
        return str(self.trainer.save_checkpoint(ckpt_root, step, extra_state=extra_state, keep_last=keep_last))

    def load_checkpoint(self, path: str) -> dict:
        extra = self.trainer.load_checkpoint(path)
        self._gather_weights()
        return extra

    def export_hf(self, path: str) -> str:
        """Write the current policy as an HF directory (config.json, safetensors, the model directory's tokenizer
        files) into ``path``; megatron: a collective (every rank is called, the writer writes). Reads the weights
        only; the RNG states are forked around it all the same, so that exporting can never change a run's bits."""
        devices = [torch.cuda.current_device()] if self.device == "cuda" and torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            if self.backend == "megatron":
                return str(self.trainer.export_hf(path, tokenizer_from=self.model_dir))
            from rlrepro.trainer import export_hf

            return str(export_hf(self.model, path, tokenizer_from=self.model_dir))



def _node_address() -> str:
    """This node's address as Ray knows it (127.0.0.1 in local mode); 127.0.0.1 outside Ray."""
    from .network import node_address

    return node_address()


def _memory_stats() -> dict:
    """Peak GPU memory since the last call (GiB), then the peak is reset; {} on CPU."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    stats = {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
             "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    torch.cuda.reset_peak_memory_stats()
    return stats

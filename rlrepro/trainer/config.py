"""The trainer's configuration: :class:`TrainConfig` (the run schema's ``train:`` section, one class for the CLI and
the Python API), :class:`CheckpointConfig` and :class:`WarmStartConfig`.

Each checks its own values in ``__post_init__`` and raises :class:`rlrepro.checks.ConfigError` naming the key a
command-line user types (``train.lr=0 ...``). Choice lists come from the registries of the modules that implement
them (``LOSS_AGG_MODES``, ``KL_ESTIMATORS``, ``ADVANTAGE_MODES``), so a new mode is never listed twice.
Adding a trainer key is two edits: a field here and the code that reads it (docs/CONTRIBUTING.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from rlrepro.checks import Checker, finite_number

from .advantages import ADVANTAGE_MODES, ADVANTAGE_STDS, uses_std
from .losses import IS_CORRECTIONS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES, policy_loss_problems

__all__ = ["TrainConfig", "CheckpointConfig", "WarmStartConfig", "BACKENDS", "GRAD_SYNCS", "CHECKPOINT_FORMATS",
           "NONFINITE_POLICIES", "WARM_START_TARGETS"]

BACKENDS = ("default", "megatron")
GRAD_SYNCS = ("ordered", "megatron")
CHECKPOINT_FORMATS = ("full", "dist")
NONFINITE_POLICIES = ("error", "skip")
WARM_START_TARGETS = ("format", "answer", "demonstration")
# verl's spellings of choices we name otherwise (algorithm.adv_estimator, actor.policy_loss.loss_mode,
# actor.kl_loss_type / algorithm.kl_penalty): refused, with ours named in the error
VERL_NAMES = {
    "advantage": {"reinforce_plus_plus": "reinforce_pp", "reinforce_plus_plus_baseline": "reinforce_pp_baseline"},
    "policy_loss": {"vanilla": "ppo_clip"},
    "kl_estimator": {"kl": "k1", "mse": "k2", "low_var_kl": "k3"},
}


@dataclass
class TrainConfig:
    """How the policy is updated (``train.*``). The LR schedule runs over ``steps`` train steps: a linear warm-up
    of ``warmup_steps`` (capped at ``steps``) then a cosine decay to ``lr * min_lr_ratio``."""
    SECTION: ClassVar[str] = "train"

    steps: int = 10
    lr: float = 1e-6
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0: no clipping (the norm is still reported)
    micro_batch_size: int = 8  # samples per forward/backward (at most, with micro_batch_tokens)
    # a token budget per micro-batch (verl's use_dynamic_bsz + ppo_max_token_len_per_gpu, slime's
    # --max-tokens-per-gpu; here per micro-batch, not per GPU): consecutive samples in batch order, prompt + completion
    # tokens, a new micro-batch where the next sample would pass it (or micro_batch_size samples); a sample longer
    # than the budget is a micro-batch of its own. A pure function of the batch, whatever the layout. 0: off
    micro_batch_tokens: int = 0
    # logits rows per float32 log-softmax chunk in the loss (0 = the whole micro-batch): less memory, the same
    # logprobs and gradients (rlrepro.trainer.logprobs.logprobs_and_entropy; the entropy metric to rounding on CUDA)
    logits_chunk_size: int = 0
    ppo_epochs: int = 1  # passes over the step's batch, each one optimizer update per mini-batch
    # samples per optimizer update (verl's ppo_mini_batch_size x rollout.n; slime's global batch below the rollout
    # batch): each PPO epoch cuts the step's batch, in its order, into consecutive mini-batches of this many samples
    # (the last one may be smaller) and takes one optimizer update on each, its loss normalised over that
    # mini-batch; micro-batches are cut within it. null: one update over the whole batch per epoch (today's step)
    mini_batch_size: Optional[int] = None
    clip_low: float = 0.2
    clip_high: float = 0.28  # DAPO's clip-higher; equal to clip_low gives PPO
    # dual clip (verl's clip_ratio_c): for A < 0 the surrogate is also bounded by -A * dual_clip; 0 = off, else > 1
    dual_clip: float = 0.0
    # entropy bonus (verl's entropy_coeff): loss -= entropy_coef * agg(entropy); 0 = off (entropy only reported)
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"  # rlrepro.trainer.losses.LOSS_AGG_MODES
    # seq-mean-token-sum-norm only: its constant C (Dr. GRPO's MAX_TOKENS; verl's padded response length), the most
    # trained tokens a sample can have. null: the rollout's rollout.max_tokens, right for single-turn; multi-turn
    # episodes (env.*) train several turns per sample: give the whole response budget (e.g. env.max_episode_tokens)
    loss_norm_tokens: Optional[int] = None
    # the per-token policy loss (rlrepro.trainer.losses.POLICY_LOSSES): ppo_clip (PPO/DAPO clipped surrogate) |
    # gspo (sequence-level ratio and clip; needs loss_agg=seq-mean-token-mean, clips ~3e-4/4e-4) | cispo (clipped,
    # detached IS weight times logp; clip_low=1: no lower bound)
    policy_loss: str = "ppo_clip"
    advantage: str = "grpo"  # rlrepro.trainer.advantages.ADVANTAGE_MODES
    # the std the advantage divides by (grpo's group std, reinforce_pp's batch std): population (divide by n) |
    # sample (by n - 1: verl's and TRL's GRPO)
    advantage_std: str = "population"
    # advantages clipped to [-advantage_clip, advantage_clip] before the loss (0 = off); bounds the step a
    # group with one outlier reward can take
    advantage_clip: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"  # rlrepro.trainer.losses.KL_ESTIMATORS
    # data-parallel trainer ranks (order-fixed gradient sum): one GPU each on CUDA, one process each on CPU
    num_gpus: int = 1
    # shard the float32 master weights and AdamW moments over the data-parallel ranks (ZeRO-1; the same bits;
    # with train.backend=megatron over its DP replicas; with checkpoint.format=dist each owner writes its share)
    distributed_optimizer: bool = False
    # seconds a collective of the trainer ranks' group (its join, a gradient sum, a broadcast) may wait for the
    # slowest rank before it fails (torch.distributed's timeout; bit-neutral): raise it where one rank's micro-batches
    # or checkpoint writes legitimately take longer
    collective_timeout_s: float = 600.0
    # seconds the driver waits for one call of the trainer actors (a train step, a checkpoint write or load, an
    # export) before it takes them as hung, stops them and ends the run (resume from the last checkpoint); null:
    # no limit. Bit-neutral. The first step's call includes compiling the kernels and the warm start
    call_timeout_s: Optional[float] = None
    # a non-finite loss or gradient norm: error (stop before the weights change; a checkpoint of the last
    # completed step is kept) | skip (weights and optimizer state untouched, LR schedule advances, step recorded)
    on_nonfinite: str = "error"
    # how the policy is held: default (the whole model per rank, data parallel over num_gpus) | megatron (sharded
    # over tensor_parallel ranks with order-fixed reductions; data parallel over num_gpus / tensor_parallel)
    backend: str = "default"
    tensor_parallel: int = 1
    # megatron only: ordered (rlrepro's rank-order gradient sum and AdamW: the same bits as the default backend)
    # | megatron (megatron-core's DistributedDataParallel and optimizer; NCCL's summation order)
    grad_sync: str = "ordered"
    # off-policy correction for stale rollouts (rollout.max_staleness > 0; rlrepro.trainer.losses, "Off-policy
    # correction"): decoupled PPO clips against the proximal policy (the weights at the start of the train step,
    # recomputed by the trainer) instead of the rollout's, and weights each token by the detached behaviour weight
    # w = pi_prox / pi_behaviour (Hilton et al. 2021; AReaL). false: today's loss, bit for bit
    decoupled: bool = False
    # the behaviour weight (needs decoupled=true): none (w untruncated) | tis (token-level, min(w, is_cap)) |
    # mis (sequence-level: the sequence's ratio, 0 outside [mis_threshold_lower, mis_threshold])
    is_correction: str = "none"
    is_cap: float = 2.0  # tis only: the truncation cap (> 0; verl's rollout_is_threshold default 2)
    mis_threshold: float = 2.0  # mis only: the upper bound on a sequence's ratio (> 1)
    # mis only: the lower bound (0 <= it < 1; 0 = none, the Seq-MIS of Liu, Li et al. 2025); null = 1/mis_threshold
    # (verl's rollout_rs_threshold_lower default)
    mis_threshold_lower: Optional[float] = None
    # the same bits on any layout (issue #26; docs/TRAINER.md, "Layout invariance"): the micro-batch gradients and
    # the loss/metric sums are folded in micro-batch order at any train.num_gpus (at one GPU that is the false
    # step itself), and row-/column-parallel reductions are computed as train.tp_partials fixed pieces (any
    # train.tensor_parallel that divides it). false: per-rank sums added in rank order, whose bits depend on the
    # layout
    layout_invariant: bool = False
    # layout_invariant only: the K-partials of every row-parallel product (and N-shards of every column-parallel
    # one) whatever TP computes them; a multiple of every train.tensor_parallel the run may use (e.g. 8). 1: plain
    # products (TP=1 only)
    tp_partials: int = 1

    def __post_init__(self) -> None:
        c = Checker(self)
        c.positive_int("steps", "micro_batch_size", "ppo_epochs", "num_gpus", "tensor_parallel")
        c.non_negative("lr", "weight_decay", "kl_coef", "clip_low", "clip_high", "max_grad_norm", "adam_eps",
                       "dual_clip", "entropy_coef", "advantage_clip")
        c.int_at_least("warmup_steps", 0)
        c.int_at_least("logits_chunk_size", 0)
        c.int_at_least("micro_batch_tokens", 0)
        c.in_range("min_lr_ratio", 0, 1)
        c.in_range("adam_beta1", 0, 1, high_inclusive=False)
        c.in_range("adam_beta2", 0, 1, high_inclusive=False)
        # cispo's weight may have no lower bound (clip_low=1: 1 - clip_low = 0, as MiniMax-M1 runs it)
        c.require(self.clip_low != 1 or self.policy_loss == "cispo", "clip_low",
                  f"must lie in [0, 1) with train.policy_loss={self.policy_loss}: 1 leaves the ratio no lower clip "
                  "bound (1 - clip_low = 0), MiniMax-M1's setting, which only train.policy_loss=cispo takes; give e.g. "
                  "train.clip_low=0.2, or set train.policy_loss=cispo")
        c.in_range("clip_low", 0, 1, high_inclusive=self.policy_loss == "cispo")
        c.choice("loss_agg", LOSS_AGG_MODES)
        c.positive_int("loss_norm_tokens", optional=True)
        m = self.mini_batch_size
        c.require(m is None or (isinstance(m, int) and not isinstance(m, bool) and m >= 1), "mini_batch_size",
                  "must be a positive number of samples per optimizer update (e.g. a quarter of "
                  "rollout.prompts_per_step x rollout.group_size for 4 updates a step), or null for one update over "
                  "the whole batch")
        c.require(self.loss_norm_tokens is None or self.loss_agg == "seq-mean-token-sum-norm", "loss_norm_tokens",
                  f"changes nothing with train.loss_agg={self.loss_agg}: it is the constant only "
                  "train.loss_agg=seq-mean-token-sum-norm divides by; leave it null or set that train.loss_agg")
        c.choice("advantage", ADVANTAGE_MODES, VERL_NAMES["advantage"])
        c.choice("advantage_std", ADVANTAGE_STDS)
        c.require(self.advantage_std == "population" or uses_std(self.advantage), "advantage_std",
                  f"changes nothing with train.advantage={self.advantage}, which divides by no std; leave "
                  f"train.advantage_std=population (or an advantage that divides by a std: "
                  f"{', '.join(m for m in ADVANTAGE_MODES if uses_std(m))})")
        c.choice("policy_loss", POLICY_LOSSES, VERL_NAMES["policy_loss"])
        problems = policy_loss_problems(self.policy_loss, loss_agg=self.loss_agg, dual_clip=self.dual_clip)
        if problems:  # all of them at once: fixing one should not reveal the next
            c.fail(problems[0][0], "; and ".join([problems[0][1]] + [f"{c.key(n)}={getattr(self, n)!r} {why}"
                                                                     for n, why in problems[1:]]))
        c.choice("kl_estimator", KL_ESTIMATORS, VERL_NAMES["kl_estimator"])
        c.require(self.kl_estimator == "k3" or self.kl_coef > 0, "kl_estimator",
                  f"changes nothing with train.kl_coef={self.kl_coef}: without a KL term the run builds no reference "
                  "model and computes no KL; set train.kl_coef > 0 (e.g. 0.001) or leave train.kl_estimator=k3")
        c.choice("on_nonfinite", NONFINITE_POLICIES)
        c.choice("backend", BACKENDS)
        c.choice("grad_sync", GRAD_SYNCS)
        c.boolean("distributed_optimizer")
        t = self.collective_timeout_s
        c.require(finite_number(t) and t > 0, "collective_timeout_s",
                  "must be a positive number of seconds a collective of the trainer ranks may wait (default 600; "
                  "e.g. train.collective_timeout_s=1800 where one rank's step legitimately runs longer)")
        t = self.call_timeout_s
        c.require(t is None or (finite_number(t) and t > 0), "call_timeout_s",
                  "must be null (no limit) or a positive number of seconds a trainer call may take (e.g. "
                  "train.call_timeout_s=3600)")
        c.require(self.lr > 0, "lr", "would never change the weights; give a learning rate > 0 (e.g. train.lr=1e-6)")
        c.require(self.adam_eps > 0, "adam_eps", "can divide by zero; give a value > 0 (e.g. train.adam_eps=1e-8)")
        c.require(self.dual_clip == 0 or self.dual_clip > 1, "dual_clip",
                  "must be 0 (off) or > 1 (the surrogate's bound -A * dual_clip for negative advantages; verl uses 3)")
        c.require(self.grad_sync != "megatron" or self.backend == "megatron", "grad_sync",
                  "(megatron-core's DistributedDataParallel and optimizer) needs train.backend=megatron; set "
                  "train.backend=megatron or train.grad_sync=ordered")
        self._check_off_policy_correction(c)
        self._check_layout_invariance(c)

    def _check_layout_invariance(self, c: Checker) -> None:
        c.boolean("layout_invariant")
        c.positive_int("tp_partials")
        c.require(self.tp_partials == 1 or self.layout_invariant, "tp_partials",
                  "changes nothing with train.layout_invariant=false; set train.layout_invariant=true or leave "
                  "train.tp_partials=1")
        if not self.layout_invariant:
            return
        tp = self.tensor_parallel if self.backend == "megatron" else 1
        c.require(self.tp_partials % tp == 0, "tp_partials",
                  f"is not a multiple of train.tensor_parallel={tp}: with train.layout_invariant=true every "
                  "tensor-parallel rank computes train.tp_partials / train.tensor_parallel of the fixed pieces; "
                  f"set train.tp_partials to a multiple of every TP size the run may use (e.g. "
                  f"train.tp_partials={max(8, tp)}) or train.tensor_parallel to a divisor of it")
        c.require(self.grad_sync == "ordered", "grad_sync",
                  "sums the gradients in NCCL's order, which depends on the layout; train.layout_invariant=true "
                  "needs train.grad_sync=ordered (or set train.layout_invariant=false)")

    @property
    def engine_tp_emulation(self) -> int:
        """The tensor-parallel split the rollout engines emulate so that their logprobs are the trainer's bits:
        ``tp_partials`` with ``layout_invariant``, else ``tensor_parallel`` on the megatron backend, else 1."""
        if self.layout_invariant:
            return self.tp_partials
        return self.tensor_parallel if self.backend == "megatron" else 1

    def _check_off_policy_correction(self, c: Checker) -> None:
        c.boolean("decoupled")
        c.choice("is_correction", IS_CORRECTIONS)
        c.require(self.is_correction == "none" or self.decoupled, "is_correction",
                  "needs train.decoupled=true: without it the PPO anchor is the rollout (behaviour) policy itself, so "
                  "there is no behaviour weight pi_prox / pi_behaviour to correct; set train.decoupled=true or "
                  "train.is_correction=none")
        c.non_negative("is_cap", "mis_threshold")
        c.require(self.is_cap > 0, "is_cap", "must be > 0 (the largest token weight train.is_correction=tis keeps; "
                                             "verl uses 2)")
        c.require(self.mis_threshold > 1, "mis_threshold",
                  "must be > 1 (the largest sequence ratio train.is_correction=mis keeps; a ratio of 1, a "
                  "sequence the proximal policy agrees with, must be kept)")
        if self.mis_threshold_lower is not None:
            c.non_negative("mis_threshold_lower")
            c.require(self.mis_threshold_lower < 1, "mis_threshold_lower",
                      "must lie in [0, 1) (the smallest sequence ratio train.is_correction=mis keeps; 0: no lower "
                      "bound; null: 1 / train.mis_threshold)")
        defaults = type(self).__dataclass_fields__
        for name, mode in (("is_cap", "tis"), ("mis_threshold", "mis"), ("mis_threshold_lower", "mis")):
            c.require(getattr(self, name) == defaults[name].default or self.is_correction == mode, name,
                      f"changes nothing with train.is_correction={self.is_correction}; it is read by "
                      f"train.is_correction={mode} only (leave it at "
                      f"{'null' if defaults[name].default is None else defaults[name].default} or set "
                      f"train.is_correction={mode})")

    # the optimizer's and the schedule's spellings
    @property
    def betas(self) -> tuple[float, float]:
        return (float(self.adam_beta1), float(self.adam_beta2))

    @property
    def mis_bounds(self) -> tuple[float, float]:
        """``(low, high)`` of ``train.is_correction=mis``: ``mis_threshold_lower`` (default ``1 / mis_threshold``)
        and ``mis_threshold``."""
        low = 1.0 / self.mis_threshold if self.mis_threshold_lower is None else float(self.mis_threshold_lower)
        return low, float(self.mis_threshold)

    @property
    def schedule_warmup_steps(self) -> int:
        """The warm-up the LR schedule runs: ``warmup_steps`` capped at the run's length (a short smoke run of a
        recipe with a long warm-up just runs, as in verl and TRL)."""
        return min(self.warmup_steps, self.steps)


@dataclass
class CheckpointConfig:
    SECTION: ClassVar[str] = "checkpoint"

    every: int = 0  # 0: only at the end
    keep_last: int = 3
    save_last: bool = True  # also after the last step (false: only every N steps; for benchmarks)
    # full: one file set with the whole state (any backend) | dist: train.backend=megatron only, every rank
    # writes its own shards through megatron-core's dist_checkpointing (no gather; loads at another TP size)
    format: str = "full"
    # also write the policy as an HF directory (config.json, safetensors, tokenizer, generation_config.json) to
    # RUN/export/step_NNNNNN/ at each checkpoint and at the end (rlrepro.orchestration.export; keep_last applies)
    export_hf: bool = False

    def __post_init__(self) -> None:
        c = Checker(self)
        c.int_at_least("every", 0)
        c.positive_int("keep_last")
        c.boolean("save_last")
        c.choice("format", CHECKPOINT_FORMATS)
        c.boolean("export_hf")


@dataclass
class WarmStartConfig:
    """Optional deterministic supervised warm-start before RL (rlrepro.trainer.warm_start), on examples drawn from
    the run's own prompts."""
    SECTION: ClassVar[str] = "warm_start"

    steps: int = 0
    lr: float = 1e-3
    batch_size: int = 32
    seed: int = 0
    # format: answers replaced by random strings of the same length over the answers' characters, so the model
    # learns to answer briefly and stop, but nothing about which answer is right; answer: the true answers (SFT);
    # demonstration: every assistant turn of the environment's own perfect episode (env.*, e.g. calculator_task's
    # call and answer), each in the transcript the episode runner would build
    target: str = "format"

    def __post_init__(self) -> None:
        c = Checker(self)
        c.int_at_least("steps", 0)
        c.non_negative("lr")
        c.positive_int("batch_size")
        c.integer("seed")
        c.choice("target", WARM_START_TARGETS)
        c.require(self.steps == 0 or self.lr > 0, "lr",
                  f"does nothing with warm_start.steps={self.steps}; give warm_start.lr > 0 or set warm_start.steps=0")

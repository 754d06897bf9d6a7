"""The run schema: the tree of the components' config dataclasses, plus the rules that span components.

=================  =====================================================================  ==========================
section            class (owner)                                                           what it configures
=================  =====================================================================  ==========================
``run``            :class:`RunConfig` (here)                                               directory, seed, device
``model``          :class:`ModelConfig` (here)                                             the starting weights
``data``           :class:`rlrepro.data.config.DataConfig`                                 prompts
``reward``         :class:`rlrepro.data.config.RewardConfig`                               the reward function
``eval``           :class:`rlrepro.data.config.EvalConfig`                                 held-out evaluation
``env``            :class:`rlrepro.envs.EnvConfig`                                         multi-turn episodes, tools
``rollout``        :class:`RolloutConfig` = ``rollout.EngineConfig`` + ``rollout.SamplingConfig`` + the driver's
                   keys (workers, prompts per step, group size, weight sync, restarts)
``train``          :class:`rlrepro.trainer.TrainConfig`                                    the update and its layout
``warm_start``     :class:`rlrepro.trainer.config.WarmStartConfig`                         supervised warm start
``checkpoint``     :class:`rlrepro.trainer.config.CheckpointConfig`                        checkpoints
``logger``         :class:`LoggerConfig` (here)                                            progress and wandb
``ray``            :class:`RayConfig` (here)                                               the Ray cluster
``repro``          :class:`ReproConfig` (here)                                             ``rlrepro diff`` settings
=================  =====================================================================  ==========================

hydra composes recipes and overrides against :class:`RunSchema` (registered as ``rlrepro_schema``), so an
unknown key fails at composition. :func:`to_schema` then builds the typed tree, which runs every component's own
checks (``__post_init__``), and :func:`validate` adds the rules that span components. Every failure is a
:class:`ConfigError` naming the key, the value and the fix, before any work starts.

The old ``trainer:`` section (``trainer.backend``, ``trainer.tensor_parallel``, ``trainer.grad_sync``) is now part
of ``train:``; :func:`migrate_legacy_keys` reads the old spellings with a warning, for one release.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

from rlrepro.checks import Checker, ConfigError, finite_number, plain_number
from rlrepro.data.config import DataConfig, EvalConfig, RewardConfig
from rlrepro.envs.config import EnvConfig
from rlrepro.rollout.config import EngineConfig, SamplingConfig
from rlrepro.trainer.config import CheckpointConfig, TrainConfig, WarmStartConfig

__all__ = ["ConfigError", "RunSchema", "RunConfig", "ModelConfig", "RolloutConfig", "LoggerConfig", "RayConfig",
           "ReproConfig", "to_schema", "validate", "uses_episodes", "validate_model_layout", "migrate_legacy_keys",
           "LEGACY_KEY_ALIASES"]


@dataclass
class RunConfig:
    SECTION: ClassVar[str] = "run"

    dir: str = "runs/${recipe}"
    seed: int = 0
    resume: bool = False
    device: str = "cpu"  # cpu | cuda
    deterministic: bool = True  # False: stock kernels in engine and trainer (the 'fast' mode, for comparison)
    save_rollouts: bool = True  # rollouts/step_NNNNNN.jsonl.gz, used by `rlrepro diff` to name the token
    # a fresh run (resume=false) refuses a run.dir that already holds records or checkpoints unless this is true
    # (then that run's records, checkpoints, base_model and data are deleted first)
    overwrite: bool = False

    def __post_init__(self) -> None:
        c = Checker(self)
        c.integer("seed")
        c.choice("device", ("cpu", "cuda"))
        c.boolean("resume", "deterministic", "save_rollouts", "overwrite")
        c.require(isinstance(self.dir, str) and self.dir.strip() != "", "dir",
                  "must name the run directory (empty, the run would write into the current directory); "
                  "e.g. run.dir=runs/my_run")


@dataclass
class ModelConfig:
    SECTION: ClassVar[str] = "model"

    path: Optional[str] = None  # HF directory (config.json, *.safetensors, tokenizer files)
    init: str = "pretrained"  # pretrained | random (seeded random weights of the checkpoint's shape) | tiny
    init_seed: int = 0
    dtype: Optional[str] = None  # None: the checkpoint's own; float32 | bfloat16
    tiny_overrides: dict = field(default_factory=dict)  # config.json overrides when init=tiny

    def __post_init__(self) -> None:
        c = Checker(self)
        c.choice("init", ("pretrained", "random", "tiny"))
        c.choice("dtype", (None, "float32", "bfloat16"))
        c.integer("init_seed")

    def check_source(self) -> None:
        """Where the weights come from (run by :func:`validate`; the defaults name no directory)."""
        if self.init in ("pretrained", "random") and not self.path:
            raise ConfigError(f"model.init={self.init} needs model.path=/path/to/hf_model_dir "
                              "(for random weights, a directory with config.json and the tokenizer)")
        if self.init == "pretrained" and not Path(self.path).is_dir():
            raise ConfigError(f"model.path={self.path!r} is not a directory; point it at a local HF model "
                              "directory (rlrepro never downloads weights)")
        if self.init == "tiny":
            self._check_tiny_overrides()

    def _check_tiny_overrides(self) -> None:
        """model.tiny_overrides makes a valid tiny config (rlrepro.model.tiny.tiny_config): a misspelt key or a bad
        value fails here, not when the run directory's base_model is written."""
        import dataclasses
        import difflib

        from rlrepro.model.config import Qwen3Config
        from rlrepro.model.tiny import build_char_tokenizer, tiny_config

        overrides = dict(self.tiny_overrides or {})
        names = [f.name for f in dataclasses.fields(Qwen3Config) if f.name not in ("extra", "generation_eos_token_ids")]
        for key in overrides:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                raise ConfigError(f"model.tiny_overrides.{key} is not a key of the tiny model's config"
                                  + (f" (did you mean model.tiny_overrides.{close[0]}?)" if close else "")
                                  + f"; the keys are {', '.join(names)}")
        try:
            tiny_config(build_char_tokenizer().get_vocab_size(with_added_tokens=True), **overrides)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"model.tiny_overrides={overrides!r} does not make a tiny model: {e}. Fix the value "
                              "(or remove the key for the tiny default)") from None


ROUND_CAP_POLICIES = ("fill", "partial", "error")


@dataclass
class RolloutConfig(EngineConfig, SamplingConfig):
    """``rollout:``: each engine's settings (:class:`EngineConfig`), the shared sampling settings
    (:class:`SamplingConfig`), and how the driver uses the engines."""
    SECTION: ClassVar[str] = "rollout"

    num_workers: int = 1
    prompts_per_step: int = 8
    group_size: int = 8
    # trainer -> engines: auto (CUDA IPC when colocated on CUDA, NCCL broadcast when not, object store on CPU) |
    # object_store | collective (torch.distributed broadcast: NCCL on CUDA, gloo on CPU) | cuda_ipc
    weight_sync: str = "auto"
    # a rollout worker that dies (process killed, actor lost) is replaced, loaded with the current weights, and
    # its unfinished requests are re-run (same keys, same samples); at most this many replacements per step
    max_restarts: int = 3
    # seconds any call on a rollout worker may take (generate / run_episodes, a weight sync or its collective
    # join, a replacement's start and first weight load) before the driver takes the worker as hung: it is killed
    # and replaced as a dead one is (max_restarts), and the call re-run. Only ever a restart, never a number
    # (orchestration.worker_calls). 0: off
    hang_timeout_s: float = 0.0
    # DAPO's dynamic sampling (Yu et al. 2025, section 3.2): a group whose rewards are all equal (zero advantage)
    # is dropped and further prompts are drawn, round after round, until prompts_per_step groups are kept
    dynamic_sampling: bool = False
    prompts_per_round: Optional[int] = None  # prompts drawn per generation round; None: prompts_per_step
    max_generation_rounds: int = 4  # rounds per step at most (dynamic_sampling=true)
    # when the rounds run out with fewer groups kept: fill (the batch is topped up with dropped groups, in draw
    # order) | partial (train on the groups kept; on the dropped ones when none was kept) | error (stop the run)
    on_round_cap: str = "fill"
    # pipelined rollouts: the samples trained at step s come from the policy of version max(0, s - 1 - K), always
    # (rlrepro.orchestration.pipeline); 0 = the synchronous loop
    max_staleness: int = 0

    def __post_init__(self) -> None:
        EngineConfig.__post_init__(self)
        SamplingConfig.__post_init__(self)
        from .weight_sync import WEIGHT_SYNC_MODES

        c = Checker(self)
        c.positive_int("num_workers", "prompts_per_step", "group_size")
        c.int_at_least("max_restarts", 0)
        c.require(finite_number(self.hang_timeout_s) and self.hang_timeout_s >= 0, "hang_timeout_s",
                  "must be a finite number of seconds > 0 (a call on a rollout worker that takes longer restarts "
                  "the worker), or 0 (off, the default)")
        c.choice("weight_sync", ("auto", *WEIGHT_SYNC_MODES))
        c.require(self.group_size >= 2, "group_size", "must be >= 2: GRPO compares samples within a group")
        c.boolean("dynamic_sampling")
        c.positive_int("prompts_per_round", optional=True)
        c.positive_int("max_generation_rounds")
        c.choice("on_round_cap", ROUND_CAP_POLICIES)
        c.int_at_least("max_staleness", 0)
        defaults = type(self).__dataclass_fields__  # the round keys are read by dynamic sampling only
        for name in ("prompts_per_round", "max_generation_rounds", "on_round_cap"):
            default = defaults[name].default
            c.require(self.dynamic_sampling or getattr(self, name) == default, name,
                      "changes nothing with rollout.dynamic_sampling=false; set rollout.dynamic_sampling=true or "
                      f"leave it at {'null' if default is None else default}")

    @property
    def engine(self) -> EngineConfig:
        return EngineConfig.of(self)

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=self.max_tokens)


@dataclass
class LoggerConfig:
    SECTION: ClassVar[str] = "logger"

    wandb: bool = False
    project: str = "rlrepro"
    mode: str = "offline"  # offline | online (online needs network and a key) | disabled
    progress: bool = True
    num_table_samples: int = 4

    def __post_init__(self) -> None:
        c = Checker(self)
        c.choice("mode", ("offline", "online", "disabled"))
        c.int_at_least("num_table_samples", 0)
        c.boolean("wandb", "progress")


@dataclass
class RayConfig:
    SECTION: ClassVar[str] = "ray"

    address: Optional[str] = None  # None: start a local Ray on 127.0.0.1; else join this cluster
    num_cpus: Optional[int] = None
    colocate: bool = True  # rollout workers and trainer share devices
    # on a cluster: the network interface (e.g. eth0, ib0) the trainer's and the weight sync's gloo / NCCL groups
    # use; None: the interface of the node's address (local mode always uses loopback)
    network_interface: Optional[str] = None
    # where the actors go (rlrepro/orchestration/placement.py, docs/CLUSTER.md): pack (as few nodes as fit),
    # spread (data-parallel replicas and engines over the nodes), split (the trainer on one node, the engines on
    # the others); a tensor-parallel group always shares one node
    placement: str = "pack"
    num_nodes: Optional[int] = None  # the alive nodes the run needs at least (checked before any actor starts)
    # a custom Ray resource (ray start --resources='{"NAME": 1}') that the trainer's / engines' nodes declare
    trainer_node: Optional[str] = None
    rollout_node: Optional[str] = None

    def __post_init__(self) -> None:
        from .placement import PLACEMENTS

        c = Checker(self)
        c.positive_int("num_cpus", "num_nodes", optional=True)
        c.boolean("colocate")
        c.choice("placement", PLACEMENTS)
        for name in ("trainer_node", "rollout_node"):
            value = getattr(self, name)
            c.require(value is None or (isinstance(value, str) and value.strip() == value and value != ""
                                        and not value.startswith(("CPU", "GPU", "node:", "memory"))), name,
                      "must be the name of a custom Ray resource the nodes declare (ray start --resources="
                      "'{\"NAME\": 1}'), not empty and not one of Ray's own (CPU, GPU, memory, node:...)")


@dataclass
class ReproConfig:
    """``rlrepro diff`` settings recorded with the run."""
    SECTION: ClassVar[str] = "repro"

    # config keys (fnmatch patterns, e.g. rollout.*) whose differences `rlrepro diff` does not list
    ignore_keys: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if not all(isinstance(k, str) for k in self.ignore_keys):
            raise ConfigError(f"repro.ignore_keys={self.ignore_keys!r} must be a list of key patterns "
                              "(e.g. [rollout.num_workers, 'logger.*'])")


@dataclass
class RunSchema:
    recipe: str = "grpo_tiny"
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    repro: ReproConfig = field(default_factory=ReproConfig)


# ----------------------------------------------------------------------------------------- old spellings
LEGACY_KEY_ALIASES = {"trainer.backend": "train.backend", "trainer.tensor_parallel": "train.tensor_parallel",
                      "trainer.grad_sync": "train.grad_sync"}


def _warn_legacy(old: str, new: str) -> None:
    print(f"rlrepro: warning: {old} is now {new} (the trainer: section was merged into train:); the old "
          "spelling is read for one more release", file=sys.stderr)


def migrate_legacy_keys(container: dict, *, warn: bool = True) -> dict:
    """Move an old ``trainer:`` section of a plain config dict (a recorded config.yaml) into ``train:``."""
    old = container.pop("trainer", None)
    if isinstance(old, dict):
        train = container.setdefault("train", {})
        for key, value in old.items():
            new = LEGACY_KEY_ALIASES.get(f"trainer.{key}")
            if new is None:
                raise ConfigError(f"trainer.{key} is not a config key (the trainer: section is now part of train:)")
            if warn:
                _warn_legacy(f"trainer.{key}", new)
            train[new.split(".", 1)[1]] = value
    return container


def migrate_override(override: str, *, warn: bool = True) -> str:
    """A command-line override in an old spelling (``trainer.backend=megatron``), rewritten with a warning."""
    prefix = "".join(ch for ch in override[:2] if ch in "+~")
    body = override[len(prefix):]
    key = body.split("=", 1)[0]
    if key in LEGACY_KEY_ALIASES:
        if warn:
            _warn_legacy(key, LEGACY_KEY_ALIASES[key])
        return prefix + LEGACY_KEY_ALIASES[key] + body[len(key):]
    return override


# ----------------------------------------------------------------------------------------- validation
def _unwrap_config_error(e: BaseException) -> BaseException:
    seen = e
    while seen is not None:
        if isinstance(seen, ConfigError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return e


def _plain_numbers(obj: Any) -> Any:
    """A plain config dict with its numpy scalars as Python numbers (OmegaConf refuses numpy, naming no key)."""
    if isinstance(obj, dict):
        return {k: _plain_numbers(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain_numbers(v) for v in obj]
    return plain_number(obj)


def to_schema(cfg: Any) -> RunSchema:
    """The typed tree of a composed config (an OmegaConf DictConfig, a plain dict, or a RunSchema), with every
    component's own checks run. Raises ConfigError."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(cfg, RunSchema):
        return cfg
    try:
        node = cfg if OmegaConf.is_config(cfg) else OmegaConf.merge(OmegaConf.structured(RunSchema),
                                                                     _plain_numbers(cfg))
        obj = OmegaConf.to_object(node)
    except ConfigError:
        raise
    except (OmegaConfBaseException, ValueError, TypeError) as e:
        inner = _unwrap_config_error(e)
        if isinstance(inner, ConfigError):
            raise ConfigError(str(inner)) from None
        raise ConfigError(f"bad config: {str(e).strip().splitlines()[0]}") from None
    if not isinstance(obj, RunSchema):
        raise ConfigError(f"the config does not follow the run schema (got {type(obj).__name__})")
    return obj


def validate(cfg: Any) -> RunSchema:
    """Every component's checks, then the rules that span components; returns the typed tree."""
    s = to_schema(cfg)
    s.model.check_source()
    if s.reward.overlong_buffer >= s.rollout.max_tokens:
        raise ConfigError(f"reward.overlong_buffer={s.reward.overlong_buffer} must be below rollout.max_tokens="
                          f"{s.rollout.max_tokens} (the penalty ramps over the last overlong_buffer tokens; DAPO "
                          "uses a quarter of the length limit)")
    note = staleness_note(s)
    if note is not None and note not in _SAID:  # said once per process (the CLI and the driver both validate)
        _SAID.add(note)
        print(f"rlrepro: note: {note}", file=sys.stderr, flush=True)
    _validate_trainer_layout(s)
    from rlrepro.trainer.updates import check_mini_batch_size  # train.mini_batch_size <= the step's samples
    check_mini_batch_size(s.train.mini_batch_size, s.rollout.prompts_per_step, s.rollout.group_size)
    _validate_dynamic_sampling(s)
    _validate_eval(s)
    _validate_env(s)
    if s.rollout.weight_sync == "cuda_ipc" and (s.run.device != "cuda" or not s.ray.colocate):
        raise ConfigError(f"rollout.weight_sync=cuda_ipc needs trainer and engines on the same GPUs "
                          f"(run.device=cuda and ray.colocate=true; here run.device={s.run.device}, "
                          f"ray.colocate={s.ray.colocate}); use rollout.weight_sync=auto")
    if s.ray.placement == "split" and s.run.device == "cuda" and s.ray.colocate:
        raise ConfigError("ray.placement=split puts the rollout engines on other nodes than the trainer, so they "
                          "cannot share its GPUs: set ray.colocate=false (or use ray.placement=pack|spread)")
    if s.rollout.weight_sync == "collective" and s.run.device == "cuda" and s.ray.colocate:
        raise ConfigError("rollout.weight_sync=collective with ray.colocate=true on CUDA would put the trainer and "
                          "an engine of one GPU into one NCCL communicator, which NCCL refuses (duplicate GPU); "
                          "use rollout.weight_sync=auto (CUDA IPC there) or ray.colocate=false")
    return s


_SAID: set = set()  # the notes validate() has printed in this process


def staleness_note(s: RunSchema) -> str | None:
    """What ``rollout.max_staleness=K >= train.steps`` means (None when K < train.steps). Allowed: batch ``s``
    comes from weight version ``max(0, s - 1 - K)`` for every ``s``, so each of the run's batches comes from the
    starting weights, and the ``K`` generated after the last step stay in its last checkpoint, where a resume with
    a larger ``train.steps`` trains them, bit for bit as one longer run would (a short first leg, later extended)."""
    k, steps = s.rollout.max_staleness, s.train.steps
    if not k or k < steps:
        return None
    return (f"rollout.max_staleness={k} >= train.steps={steps}: every batch of this run comes from the starting "
            f"weights (batch s from weight version max(0, s - 1 - {k}) = 0), and the {k} batches generated after "
            f"step {steps} stay in its last checkpoint, trained only if a resume raises train.steps (it may when "
            "train.min_lr_ratio=1.0 and train.warmup_steps <= train.steps, so that no step's LR changes); for a run "
            "that is not to be extended, use rollout.max_staleness < train.steps")


def uses_episodes(s: RunSchema) -> bool:
    """Whether the run's samples come from the episode runner (``env.name`` or ``env.fn`` set; the default, both
    null, is the single-turn path of ``rollout.*`` with ``reward.fn`` alone)."""
    return s.env.name is not None or s.env.fn is not None


def _validate_env(s: RunSchema) -> None:
    """env.* against the rest."""
    if s.warm_start.target == "demonstration" and s.warm_start.steps > 0 and not uses_episodes(s):
        raise ConfigError("warm_start.target=demonstration replays the environment's demonstration: set env.name "
                          "(e.g. env.name=calculator_task) or env.fn, or another warm_start.target")
    if not uses_episodes(s):
        return
    if s.reward.overlong_buffer:
        raise ConfigError(f"reward.overlong_buffer={s.reward.overlong_buffer} shapes single-turn completions by "
                          "length; with env.* the environment scores the episode (use env.max_episode_tokens and "
                          "its finish reason token_budget): set reward.overlong_buffer=0")
    if s.train.loss_agg == "seq-mean-token-sum-norm" and s.train.loss_norm_tokens is None:
        budget = s.env.max_episode_tokens or s.rollout.max_model_len
        example = budget if budget is not None else "<the episode's token budget>"
        raise ConfigError(f"train.loss_agg=seq-mean-token-sum-norm divides each sample's token sum by a constant that "
                          f"must bound its trained tokens; it defaults to rollout.max_tokens={s.rollout.max_tokens}, "
                          "one turn's budget, but an episode (env.*) trains every policy turn. Fix: set "
                          f"train.loss_norm_tokens={example} (the whole response budget: env.max_episode_tokens or "
                          "rollout.max_model_len), or another train.loss_agg")
    max_len = s.rollout.max_model_len
    if max_len is not None and s.env.max_episode_tokens is not None and s.env.max_episode_tokens > max_len:
        raise ConfigError(f"env.max_episode_tokens={s.env.max_episode_tokens} exceeds rollout.max_model_len="
                          f"{max_len}: a transcript cannot be longer than the engine's context")


def _validate_dynamic_sampling(s: RunSchema) -> None:
    """rollout.dynamic_sampling drops the groups of equal rewards: only right where such a group has advantage 0."""
    from rlrepro.trainer.advantages import ADVANTAGE_MODES, zeroes_equal_groups

    adv = s.train.advantage
    if s.rollout.dynamic_sampling and not zeroes_equal_groups(adv):
        fits = ", ".join(m for m in ADVANTAGE_MODES if zeroes_equal_groups(m))
        raise ConfigError(f"rollout.dynamic_sampling=true drops every group whose rewards are all equal, but with "
                          f"train.advantage={adv} (normalised over the whole batch, no group baseline) such a group "
                          "still has a nonzero advantage, so dropping it would change what is trained. Fix: set "
                          f"rollout.dynamic_sampling=false, or an advantage with a group baseline (train.advantage="
                          f"{fits})")


def _validate_eval(s: RunSchema) -> None:
    """eval.* against the rest: a source to evaluate, a usable temperature, a length the prompts leave room for."""
    from rlrepro.rollout.config import MIN_TEMPERATURE

    e = s.eval
    if e.every > 0 and not e.source:
        raise ConfigError(f"eval.every={e.every} needs eval.source=/path/to/held_out.jsonl (a local file or "
                          "directory, read like data.source); or set eval.every=0 (off)")
    if e.temperature is not None and 0 < e.temperature < MIN_TEMPERATURE:
        raise ConfigError(f"eval.temperature={e.temperature!r} is too small (logits / T overflows); use 0 for "
                          f"greedy decoding or a value >= {MIN_TEMPERATURE}")


def _validate_trainer_layout(s: RunSchema, model_config: Any = None) -> None:
    """train.backend / train.tensor_parallel against train.num_gpus (and the model's shape when given)."""
    from rlrepro.trainer.megatron import validate_megatron_config
    from rlrepro.trainer.megatron.config import check_divides_model

    t = s.train
    try:
        validate_megatron_config(t.backend, t.tensor_parallel, t.num_gpus, s.run.device, model_config)
    except (ValueError, ImportError) as e:
        raise ConfigError(str(e)) from None
    if t.layout_invariant:
        try:
            check_divides_model("train.tp_partials", t.tp_partials, model_config, "every product is cut into equal "
                                "pieces")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if s.checkpoint.format == "dist" and t.backend != "megatron":
        raise ConfigError("checkpoint.format=dist writes tensor-parallel shards: it needs train.backend=megatron; "
                          "use checkpoint.format=full")
    if t.backend == "megatron" and s.warm_start.steps > 0:
        raise ConfigError(f"warm_start.steps={s.warm_start.steps} is not supported with train.backend=megatron "
                          "(the warm start trains the unsharded model); set warm_start.steps=0 or "
                          "train.backend=default")


def validate_model_layout(s: RunSchema, model_config: Any) -> None:
    """The checks that need the model's shape (heads, KV heads, MLP width and vocabulary divisible by TP); run
    once the model directory exists, before any actor starts."""
    _validate_trainer_layout(s, model_config)

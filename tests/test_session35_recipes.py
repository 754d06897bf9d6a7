"""Every shipped recipe, as a new user meets it: it composes and validates, so do the override sets its comments,
the README and scripts/gpu_grpo.sh tell a user to type, every dotted key its comments name is a key of its composed
config, the values its comments quote are the file's, and the files they point at exist.

CPU only, no run: composing configs (``rlrepro.cli.compose_config``) and ``validate``. The 8B recipes leave
model.path and data.source to the user (``???``): a temporary directory and data file stand in (the checks before
any work look at neither's contents).
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlrepro.cli import RECIPES_DIR, compose_config, list_recipes
from rlrepro.orchestration.config import ConfigError, RunSchema, validate

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ["grpo_qwen3_8b", "grpo_qwen3_8b_tool", "grpo_tiny", "grpo_tiny_tool"]
SECTIONS = tuple(f.name for f in dataclasses.fields(RunSchema) if f.name != "recipe")
DOTTED = re.compile(r"(?<![\w./-])((?:%s)(?:\.\w+)+)(=\S+)?" % "|".join(SECTIONS))
MISSING = object()
FILE_ENDINGS = ("sh", "py", "md", "yaml", "json", "jsonl", "parquet")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes35")
    (root / "model").mkdir()
    (root / "data.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    return {"M": str(root / "model"), "D": str(root / "data.jsonl")}


def needs(recipe: str) -> bool:
    return bool(OmegaConf.missing_keys(OmegaConf.load(RECIPES_DIR / f"{recipe}.yaml")))


def compose(recipe: str, overrides: list[str], paths: dict):
    """compose_config (validate runs inside it) and validate again on the result, as the brief's check does."""
    given = {o.split("=", 1)[0] for o in overrides}
    fill = [f"{k}={paths[v]}" for k, v in (("model.path", "M"), ("data.source", "D"))
            if needs(recipe) and k not in given]
    items = [o.format(**paths) for o in overrides]
    cfg = compose_config([f"recipe={recipe}", *fill, *items])
    validate(cfg)
    return cfg


def comment_lines(recipe: str) -> list[str]:
    return [line.split("#", 1)[1] for line in (RECIPES_DIR / f"{recipe}.yaml").read_text().splitlines()
            if "#" in line and not line.lstrip().startswith(("template", "- "))]


def test_the_shipped_recipes_are_these():
    assert list_recipes() == RECIPES


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_validates(recipe, paths):
    cfg = compose(recipe, [], paths)
    assert cfg.recipe == recipe


@pytest.mark.parametrize("recipe", ["grpo_qwen3_8b", "grpo_qwen3_8b_tool"])
def test_8b_recipe_without_path_and_data_is_refused(recipe):
    with pytest.raises(ConfigError, match="model.path"):
        compose_config([f"recipe={recipe}"])


# ------------------------------------------------------------------------------ override sets the docs suggest
DOCUMENTED = {
    "grpo_qwen3_8b": [
        # the recipe's header (and docker/Dockerfile's): pretrained weights, or their shape with random weights
        ["model.path={M}", "data.source={D}"],
        ["model.path={M}", "model.init=random", "data.source={D}"],
        ["train.kl_coef=0.001", "train.kl_estimator=k3"],  # verl's KL term
        ["train.tensor_parallel=2"],  # "TP stays available"
        ["train.grad_sync=megatron"],  # the comment on grad_sync
        ["data.source=someorg/math", "data.allow_hub=true"],  # "a hub data set name needs data.allow_hub=true"
        ["train.steps=4"],  # README: a short smoke run of a recipe
    ],
    "grpo_qwen3_8b_tool": [
        ["model.path={M}", "data.source={D}"],
        ["data.source=someorg/math", "data.allow_hub=true"],
        ["train.steps=4"],
    ],
    "grpo_tiny": [
        ["train.steps=2"],
        ["train.steps=4"],
        ["warm_start.steps=50"],  # "warm_start.steps > 0 adds a deterministic supervised warm-start"
        # README: the second run with other engine settings and two rollout workers
        ["run.dir=runs/b", "rollout.num_workers=2", "rollout.max_num_seqs=48",
         "rollout.max_num_batched_tokens=333", "rollout.prefix_cache=false"],
        # README's command-line section
        ["run.dir=runs/a", "run.seed=1", "train.steps=20", "rollout.num_workers=2", "rollout.max_num_seqs=64",
         "rollout.max_num_batched_tokens=2048", "rollout.prefix_cache=true", "checkpoint.every=5",
         "run.resume=false"],
    ],
    "grpo_tiny_tool": [
        ["train.steps=2", "warm_start.steps=0"],  # README: a smoke run of the plumbing alone
        ["train.steps=4"],
    ],
}

# scripts/gpu_grpo.sh, each GRPO_SET's runs (recipe=grpo_qwen3_8b); {M}: the directory make_qwen3_shape.py writes
COMMON = ["run.device=cuda", "model.dtype=bfloat16", "data.source=null", "data.synthetic.task=copy",
          "data.use_chat_template=false", "data.template=null", "reward.fn=hash", "rollout.prompts_per_step=16",
          "rollout.group_size=8", "rollout.max_tokens=128", "rollout.max_model_len=512",
          "rollout.gpu_memory_fraction=0.2", "train.steps=3", "train.warmup_steps=1", "train.micro_batch_size=16",
          "logger.wandb=false", "checkpoint.every=0", "checkpoint.save_last=false", "logger.progress=true"]
FIRST = ["model.init=random", "model.path={M}"]  # the set's first run creates the weights ...
LATER = ["model.init=pretrained", "model.path={M}"]  # ... the others load them
DEF = ["train.backend=default", "train.tensor_parallel=1", "train.distributed_optimizer=false"]
ONE = ["train.num_gpus=1", "rollout.num_workers=1", "ray.colocate=true", *DEF]
TWO_GPUS = ["train.num_gpus=2", "rollout.num_workers=2", "ray.colocate=true"]
TWO = [*TWO_GPUS, *DEF]
SEQS = ["rollout.max_num_seqs=7", "rollout.max_num_batched_tokens=999"]
PIPE = [*ONE, "train.steps=6"]
K1 = ["rollout.max_staleness=1", "train.decoupled=true", "train.is_correction=tis"]
MC = [*TWO_GPUS, "train.backend=megatron", "train.tensor_parallel=1", "train.grad_sync=megatron",
      "train.distributed_optimizer=true"]
GPU_GRPO = {
    "one/a": FIRST + ONE + ["checkpoint.every=2"], "one/b": LATER + ONE, "one/c": LATER + ONE + SEQS,
    "one/f": LATER + ONE + ["run.deterministic=false"], "one/d": LATER + ONE + ["run.resume=true"],
    "fa3/a": FIRST + ONE, "fa3/c": LATER + ONE + SEQS,
    "pipeline/q0": FIRST + PIPE, "pipeline/q1": LATER + PIPE + K1, "pipeline/q1c": LATER + PIPE + K1 + SEQS,
    "pipeline/q2": LATER + PIPE + ["rollout.max_staleness=2", "train.decoupled=true", "train.is_correction=tis"],
    "layout/l1": FIRST + ONE + ["train.layout_invariant=true", "train.tp_partials=8"],
    "layout/l2": LATER + ONE + ["train.layout_invariant=true", "train.tp_partials=8"],
    "eight/x1": FIRST, "eight/x2": LATER,
    "full/p1": FIRST + TWO_GPUS + ["train.backend=megatron", "train.tensor_parallel=2",
                                   "rollout.gpu_memory_fraction=0.05", "train.micro_batch_size=8"],
    "two/g": FIRST + TWO, "two/h": LATER + TWO,
    "two/s": LATER + ["train.num_gpus=1", "rollout.num_workers=1", "ray.colocate=false", "train.backend=megatron",
                      "train.tensor_parallel=1"],
    "two/m1": LATER + TWO_GPUS + ["train.backend=megatron", "train.tensor_parallel=2"],
    "two/m0": LATER + TWO_GPUS + ["train.backend=megatron", "train.tensor_parallel=1"],
    "two/z": LATER + TWO + ["train.distributed_optimizer=true"],
    "two/k1": LATER + MC, "two/f2": LATER + TWO + ["run.deterministic=false"],
    # the script's CPU smoke test: GRPO_SMALL=1 GRPO_DEVICE=cpu GRPO_DTYPE=float32 GRPO_MAX_TOKENS=8
    "cpu/a": FIRST + ONE + ["run.device=cpu", "model.dtype=float32", "rollout.max_tokens=8"],
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_documented_override_sets_compose(recipe, paths):
    for overrides in DOCUMENTED[recipe]:
        cfg = compose(recipe, overrides, paths)
        for item in overrides:
            key, value = item.split("=", 1)
            if key not in ("run.dir", "model.path", "data.source"):
                assert str(OmegaConf.select(cfg, key)).lower() == value.lower(), item


@pytest.mark.parametrize("name", sorted(GPU_GRPO))
def test_gpu_grpo_sets_compose(name, paths):
    overrides = ["run.dir={M}/run", *COMMON, *GPU_GRPO[name]]
    s = validate(compose("grpo_qwen3_8b", overrides, paths))
    assert s.model.path == paths["M"] and s.data.source is None


def test_gpu_grpo_sets_are_the_scripts():
    """Every override scripts/gpu_grpo.sh passes (its ${VAR:-default}s at their defaults) is in one of the sets
    above, so that a set the script gains or changes is checked here too."""
    text = (ROOT / "scripts" / "gpu_grpo.sh").read_text()
    text = re.sub(r"(^|\s)#.*", "", text, flags=re.M)  # comments: they describe the runs
    text = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)
    script = {w.strip('"') for w in re.findall(r'"?(?:%s)\.[\w.]+=[^\s");]+' % "|".join(SECTIONS), text)
              if "$" not in w}
    script -= {"run.dir=", "model.path="}
    ours = {o for sets in GPU_GRPO.values() for o in sets} | set(COMMON)
    assert len(script) >= 30
    assert sorted(script - ours) == []


# ------------------------------------------------------------------------------------------ what comments say
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_key_a_comment_names_exists(recipe, paths):
    cfg = compose(recipe, [], paths)
    named = [m.group(1) for line in comment_lines(recipe) for m in DOTTED.finditer(line)
             if m.group(1).rsplit(".", 1)[1] not in FILE_ENDINGS]  # not a file name: SimpleTIR's train.sh
    assert named
    bad = [k for k in named if OmegaConf.select(cfg, k, default=MISSING) is MISSING]
    assert bad == []


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_override_a_comment_writes_composes(recipe, paths):
    """``key=value`` in a comment line (``train.kl_coef=0.001 train.kl_estimator=k3``), applied together, hold."""
    for line in comment_lines(recipe):
        items = [m.group(0) for m in DOTTED.finditer(line) if m.group(2)]
        items = [re.sub(r"[,;.:)]+$", "", i) for i in items if not i.startswith(("model.path=", "data.source="))]
        if items:
            compose(recipe, items, paths)


@pytest.mark.parametrize("recipe", RECIPES)
def test_files_a_comment_names_exist(recipe):
    names = re.findall(r"(?<![\w/])((?:docs|tests|scripts)/[\w./]+\.\w+|README\.md)", " ".join(comment_lines(recipe)))
    assert all((ROOT / n.rstrip(".")).exists() for n in names), names


# (recipe, words of its comment, dotted key, the file's value): the figures a comment quotes are the file's
QUOTED = [
    ("grpo_qwen3_8b", "128 prompts x 8 samples = 1024 rollouts", "rollout.prompts_per_step", 128),
    ("grpo_qwen3_8b", "128 prompts x 8 samples", "rollout.group_size", 8),
    ("grpo_qwen3_8b", "1k prompt / 2k response tokens", "data.max_prompt_tokens", 1024),
    ("grpo_qwen3_8b", "1k prompt / 2k response tokens", "rollout.max_tokens", 2048),
    ("grpo_qwen3_8b", "lr 1e-6 with warm-up", "train.lr", 1e-6),
    ("grpo_qwen3_8b", "token-mean loss, clip 0.2 / 0.28, no KL term", "train.kl_coef", 0.0),
    ("grpo_qwen3_8b", "clip 0.2 / 0.28", "train.clip_high", 0.28),
    ("grpo_qwen3_8b", "4 rollout engines on GPUs of their own", "rollout.num_workers", 4),
    ("grpo_qwen3_8b", "4 rollout engines on GPUs of their own", "ray.colocate", False),
    ("grpo_qwen3_8b", "the trainer data parallel on the other 4", "train.num_gpus", 4),
    ("grpo_qwen3_8b", "(train.backend=megatron, tensor_parallel=1)", "train.tensor_parallel", 1),
    ("grpo_qwen3_8b", "train.distributed_optimizer=true", "train.distributed_optimizer", True),
    ("grpo_qwen3_8b_tool", "env.tools=[python]", "env.tools", ["python"]),
    ("grpo_qwen3_8b_tool", "max_turns 8 (between", "env.max_turns", 8),
    ("grpo_qwen3_8b_tool", "a 12,288-token transcript", "env.max_episode_tokens", 12288),
    ("grpo_qwen3_8b_tool", "4,096 generated tokens per turn", "rollout.max_tokens", 4096),
    ("grpo_qwen3_8b_tool", "10 warm-up", "train.warmup_steps", 10),
    ("grpo_qwen3_8b_tool", "dual clip 10 (ReTool's", "train.dual_clip", 10.0),
    ("grpo_qwen3_8b_tool", "one pass over the batch per step", "train.ppo_epochs", 1),
    ("grpo_qwen3_8b_tool", "the engines take 0.6 of their GPU", "rollout.gpu_memory_fraction", 0.6),
    ("grpo_qwen3_8b_tool", "micro-batches of 1 with the chunked", "train.micro_batch_size", 1),
    ("grpo_qwen3_8b_tool", "micro-batches of 1 with the chunked", "train.logits_chunk_size", 1024),
    ("grpo_qwen3_8b_tool", "4 rollout engines on GPUs of their own", "rollout.num_workers", 4),
    ("grpo_qwen3_8b_tool", "(megatron backend, TP=1, ZeRO-1)", "train.backend", "megatron"),
    ("grpo_tiny", "The model has 2 layers, hidden size 64", "model.tiny_overrides.num_hidden_layers", 2),
    ("grpo_tiny", "The model has 2 layers, hidden size 64", "model.tiny_overrides.hidden_size", 64),
    ("grpo_tiny", "on a CPU", "run.device", "cpu"),
    ("grpo_tiny", "its 80 steps", "train.steps", 80),
    ("grpo_tiny", "exact-match reward", "reward.fn", "exact_match"),
    ("grpo_tiny", "short string over 'abcd'", "data.synthetic.kwargs.alphabet", "abcd"),
    ("grpo_tiny_tool", "2-digit multiplication", "data.synthetic.kwargs.digits", 2),
    ("grpo_tiny_tool", "in the compact tool format", "env.tool_format", "compact"),
    ("grpo_tiny_tool", "(warm_start.target=demonstration)", "warm_start.target", "demonstration"),
    ("grpo_tiny_tool", "exact-match reward", "reward.fn", "exact_match"),
    ("grpo_tiny_tool", "on a CPU", "run.device", "cpu"),
]


@pytest.mark.parametrize("recipe", RECIPES)
def test_figures_a_comment_quotes_are_the_files(recipe, paths):
    cfg = compose(recipe, [], paths)
    text = " ".join(" ".join(line.split()) for line in comment_lines(recipe))
    rows = [row for row in QUOTED if row[0] == recipe]
    assert rows
    for _, words, key, value in rows:
        assert words in text, words
        got = OmegaConf.select(cfg, key)
        assert (OmegaConf.to_object(got) if OmegaConf.is_config(got) else got) == value, key


def test_grpo_tiny_run_time_agrees_with_the_readme():
    """The recipe's header and the README's install line quote one run time for grpo_tiny on 2 cores."""
    recipe = " ".join(" ".join(line.split()) for line in comment_lines("grpo_tiny"))
    readme = next(line for line in (ROOT / "README.md").read_text().splitlines() if "recipe=grpo_tiny" not in line
                  and "the embedded default" in line)
    said = re.search(r"(\d+(?:\.\d+)?) minutes on 2 cores", readme)
    assert said, readme
    assert f"in about {said.group(1)} minutes" in recipe

"""Bad input to a run, tried systematically: data sets with missing or wrong fields, empty, over-long or
non-UTF-8 prompts; model directories with missing or truncated shards and mismatched tokenizers; reward
functions that raise or return non-numbers; a run directory that already holds a run.

Each fails in the driver's set-up with an error naming the value and the fix, before Ray starts (the actor group is
replaced by a stub that records being reached), and leaves what the run directory already held unchanged.
No Ray, tiny models: fast."""
import hashlib
import json
import shutil
import sys
import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rlrepro.cli import compose_config, main
from rlrepro.model import write_tiny_checkpoint
from rlrepro.orchestration import driver as driver_mod
from rlrepro.orchestration.config import ConfigError

HSET = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
COMMON = ["rollout.prompts_per_step=1", "rollout.group_size=2", "rollout.max_tokens=4", "train.steps=1",
          "train.warmup_steps=0", "logger.progress=false", "data.max_prompt_tokens=24"]


class Reached(Exception):
    """Set-up passed every check and would now start Ray."""


class StubActors:
    def __init__(self, *a, **k):
        raise Reached


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: StubActors)


def setup_run(run_dir, *overrides):
    """Run the driver's set-up; return None when every check passed, else the exception."""
    resume = [] if any(o.startswith("run.resume=") for o in overrides) else ["run.resume=true"]
    cfg = compose_config(["recipe=grpo_tiny", *COMMON, f"run.dir={run_dir}", *resume, *overrides])
    d = driver_mod.GRPODriver(cfg)
    try:
        driver_mod.preflight.check_run_dir(d.cfg, d.run_dir, fresh=not cfg.run.resume)
        d.setup()
    except Reached:
        return None
    except (ConfigError, ValueError, FileNotFoundError) as e:
        return e
    raise AssertionError("set-up neither failed nor reached the cluster")


def tree_digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def unchanged(root: Path, before: dict) -> bool:
    """Every file that was there is still there, byte for byte (new files, like base_model/, may appear)."""
    after = tree_digest(root)
    return all(after.get(k) == v for k, v in before.items())


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory):
    """A run directory holding an earlier run's records (what must never be damaged)."""
    run = tmp_path_factory.mktemp("existing") / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("recipe: grpo_tiny\n# the earlier run's config\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 0.5}) + "\n")
    (run / "fingerprints.jsonl").write_text(json.dumps({"step": 1, "loss": "ab"}) + "\n")
    return run


# ------------------------------------------------------------------------------------------------ data sets

ROW_KINDS = {
    # kind: (raw line or row dict, field the error must name, whether the error names the row)
    "ok": ({"prompt": "copy: ab=", "answer": "ab"}, None, False),
    "ok_number_answer": ({"prompt": "copy: 12=", "answer": 12}, None, False),
    "missing_prompt": ({"answer": "ab"}, "prompt", True),
    "null_prompt": ({"prompt": None, "answer": "ab"}, "prompt", True),
    "empty_prompt": ({"prompt": "", "answer": "ab"}, "prompt", True),
    "blank_prompt": ({"prompt": "   ", "answer": "ab"}, "prompt", True),
    "missing_answer": ({"prompt": "copy: ab="}, "answer", True),
    "empty_answer": ({"prompt": "copy: ab=", "answer": ""}, "answer", True),
    "long_prompt": ({"prompt": "copy: " + "ab" * 20 + "=", "answer": "ab"}, "data.max_prompt_tokens", False),
    "not_utf8": (b'{"prompt": "copy: \xff\xfe=", "answer": "ab"}', "UTF-8", True),
    "lone_surrogate": (b'{"prompt": "copy: \\ud800=", "answer": "ab"}', "UTF-8", True),
    "not_json": (b'{"prompt": "copy: ab=", "answer": ', "JSON", True),
}


def write_rows(path: Path, kinds: list[str]) -> None:
    lines = []
    for k in kinds:
        row = ROW_KINDS[k][0]
        lines.append(row if isinstance(row, bytes) else json.dumps(row).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")


@settings(HSET, max_examples=40)
@given(kinds=st.lists(st.sampled_from(sorted(ROW_KINDS)), min_size=1, max_size=6))
@example(kinds=["ok", "ok_number_answer", "lone_surrogate"])  # CI's 2026-12-06 failure: a mixed answer column
def test_data_sets_fail_naming_the_row_and_field_or_load(tmp_path_factory, existing_run, kinds):
    data = tmp_path_factory.mktemp("data") / "rows.jsonl"
    write_rows(data, kinds)
    before = tree_digest(existing_run)
    err = setup_run(existing_run, f"data.source={data}")
    bad = [(i, k) for i, k in enumerate(kinds) if ROW_KINDS[k][1] is not None]
    if not bad:
        assert err is None, err
        return
    assert err is not None, f"{kinds} was accepted"
    msg = str(err)
    i, kind = bad[0]
    _, needle, names_row = ROW_KINDS[kind]
    # the row-level loader reports the first bad row (pyarrow may first reject a file whose rows cannot share a
    # schema: then the message names the file); an over-long prompt is named by its uid
    assert "rows.jsonl" in msg, msg
    if kind == "long_prompt" and not any(ROW_KINDS[k][2] for _, k in bad):
        assert f"rows.jsonl:{i}" in msg and needle in msg, msg
    assert unchanged(existing_run, before)  # nothing the directory held was touched


def test_over_long_prompts_are_left_out_with_on_bad_row_skip(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    write_rows(data, ["ok", "long_prompt", "ok"])
    assert setup_run(tmp_path / "run", f"data.source={data}", "data.on_bad_row=skip") is None
    assert "left out 1 prompt" in capsys.readouterr().err
    write_rows(data, ["long_prompt"])
    err = setup_run(tmp_path / "run2", f"data.source={data}", "data.on_bad_row=skip")
    assert isinstance(err, ConfigError) and "data.max_prompt_tokens" in str(err)


def test_prompt_plus_max_tokens_beyond_the_context_fails_before_work(tmp_path):
    err = setup_run(tmp_path / "run", "rollout.max_model_len=12", "rollout.max_tokens=8")
    assert isinstance(err, ConfigError)
    assert "rollout.max_tokens" in str(err) and "rollout.max_model_len" in str(err)
    err = setup_run(tmp_path / "run", "rollout.num_kv_blocks=1", "rollout.block_size=4")
    assert isinstance(err, ConfigError) and "rollout.num_kv_blocks" in str(err)



def test_a_refused_start_leaves_nothing_behind(tmp_path, capsys):
    # a bad data.source is found after the lock and the base model were written: the base model goes again (it
    # stayed), and the directory the start created with it, its lock file too (run_lock.py: removed while locked)
    missing = tmp_path / "no_such.jsonl"
    run = tmp_path / "new_run"
    assert main(["train", "recipe=grpo_tiny", *COMMON, f"run.dir={run}", f"data.source={missing}"]) == 2
    assert "no_such.jsonl" in capsys.readouterr().err
    assert not run.exists()
    # a directory that was there keeps exactly what it held
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert main(["train", "recipe=grpo_tiny", *COMMON, f"run.dir={kept}", f"data.source={missing}"]) == 2
    assert sorted(p.name for p in kept.iterdir()) == [".lock", "notes.txt"]


def test_micro_batch_token_budget_below_the_longest_sample_fails_before_work(tmp_path):
    # COMMON: rollout.max_tokens=4; grpo_tiny's synthetic prompts are longer than 1 token, so 5 is too small
    err = setup_run(tmp_path / "run", "train.micro_batch_tokens=5")
    assert isinstance(err, ConfigError)
    assert "train.micro_batch_tokens=5" in str(err) and "Fix: set train.micro_batch_tokens>=" in str(err)
    assert setup_run(tmp_path / "run2", "train.micro_batch_tokens=28") is None  # 24 prompt tokens at most + 4
    with pytest.raises(ConfigError, match=r"train.micro_batch_tokens=-1 must be an integer >= 0"):
        compose_config(["recipe=grpo_tiny", "train.micro_batch_tokens=-1"])

def test_tp_partials_that_do_not_divide_the_model_fail_before_work(tmp_path):
    err = setup_run(tmp_path / "run", "train.layout_invariant=true", "train.tp_partials=3")
    assert isinstance(err, ConfigError), err
    assert "train.tp_partials=3 does not divide the model's num_attention_heads=4" in str(err)
    assert "choose train.tp_partials from [1, 2" in str(err)
    assert setup_run(tmp_path / "run2", "train.layout_invariant=true", "train.tp_partials=2") is None


def test_env_problems_fail_before_work(tmp_path):
    # an option the environment does not take: found at set-up (the environment of the first prompt is created),
    # not at step 1 after Ray and the warm start
    tool = ["env.name=calculator_task", "data.use_chat_template=true", "data.max_prompt_tokens=64",
            "env.tool_format=compact"]
    err = setup_run(tmp_path / "run", *tool, "+env.kwargs={digits: 3}")
    assert isinstance(err, ConfigError), err
    assert "calculator_task" in str(err) and "digits" in str(err) and "env.kwargs" in str(err)
    assert setup_run(tmp_path / "run2", *tool) is None
    # the tiny model's chat template ignores tools=: with tool_format=qwen3 the model would never see its tools
    err = setup_run(tmp_path / "run2d", *tool[:3], "env.tool_format=qwen3")
    assert isinstance(err, ConfigError) and "chat template ignores tools=" in str(err), err
    # tools without the chat template (which renders their schemas): at set-up too, not at step 1
    err = setup_run(tmp_path / "run2b", "env.name=calculator_task", "data.max_prompt_tokens=64",
                    "data.use_chat_template=false")
    assert isinstance(err, ConfigError) and "data.use_chat_template=true" in str(err), err
    # a budget the prompt alone reaches: every episode would end before its first token (a run training on nothing)
    err = setup_run(tmp_path / "run3", "env.name=single_turn", "env.max_episode_tokens=3")
    assert isinstance(err, ConfigError) and "env.max_episode_tokens=3" in str(err) and "Fix: raise" in str(err)
    # an episode prompt (tools' schemas included) that fills the engine's context: every episode would be empty
    from types import SimpleNamespace

    from rlrepro.orchestration.config import to_schema
    cfg = to_schema(compose_config(["recipe=grpo_tiny", "env.name=calculator_task", "rollout.max_model_len=30"]))
    driver_mod.preflight.check_episode_prompt(cfg, "u", 29, SimpleNamespace(max_position_embeddings=1024))
    with pytest.raises(ConfigError, match=r"prompt 'u' starts its episode with 30 tokens, the engine's context \(30\)"):
        driver_mod.preflight.check_episode_prompt(cfg, "u", 30, SimpleNamespace(max_position_embeddings=1024))
    # rollout.max_staleness >= train.steps is allowed (a short leg a resume extends: tests/test_session36_config.py)
    assert setup_run(tmp_path / "run4", "rollout.max_staleness=3", "train.steps=3") is None
    assert setup_run(tmp_path / "run5", "rollout.max_staleness=2", "train.steps=3") is None


# ------------------------------------------------------------------------------------------ model directories

@pytest.fixture(scope="module")
def sharded_model(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m") / "sharded", seed=0, max_shard_bytes=60_000)


def damaged_copy(src: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


@settings(HSET, max_examples=25)
@given(shard=st.integers(0, 10_000), cut=st.floats(0.0, 0.999))
def test_truncated_shard_fails_naming_the_file(tmp_path_factory, sharded_model, shard, cut):
    model = damaged_copy(sharded_model, tmp_path_factory.mktemp("trunc") / "model")
    shards = sorted(model.glob("model-*.safetensors"))
    f = shards[shard % len(shards)]
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * cut)])
    err = setup_run(model.parent / "run", "model.init=pretrained", f"model.path={model}")
    assert isinstance(err, ValueError) and f.name in str(err) and "truncated or corrupt" in str(err), err


def test_missing_shard_and_missing_tensor_fail_naming_them(tmp_path, sharded_model):
    model = damaged_copy(sharded_model, tmp_path / "m1")
    shards = sorted(model.glob("model-*.safetensors"))
    assert len(shards) >= 2
    shards[-1].unlink()
    err = setup_run(tmp_path / "run", "model.init=pretrained", f"model.path={model}")
    assert isinstance(err, FileNotFoundError) and shards[-1].name in str(err)

    model = damaged_copy(sharded_model, tmp_path / "m2")
    index = json.loads((model / "model.safetensors.index.json").read_text())
    gone = shards[0].name
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != gone}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    (model / gone).unlink()
    err = setup_run(tmp_path / "run", "model.init=pretrained", f"model.path={model}")
    assert isinstance(err, ValueError) and "lacks tensors" in str(err)


@pytest.mark.parametrize("damage,needle", [
    ("config_not_json", "config.json is not valid JSON"),
    ("config_wrong_shape", "config.json implies"),
    ("no_config", "no config.json"),
    ("no_tokenizer", "no tokenizer.json"),
    ("no_weights", "no *.safetensors"),
])
def test_damaged_model_directories(tmp_path, sharded_model, damage, needle):
    model = damaged_copy(sharded_model, tmp_path / "m")
    if damage == "config_not_json":
        (model / "config.json").write_text('{"vocab_size": 12,')
    elif damage == "config_wrong_shape":
        cfg = json.loads((model / "config.json").read_text())
        cfg["intermediate_size"] = 96
        (model / "config.json").write_text(json.dumps(cfg))
    elif damage == "no_config":
        (model / "config.json").unlink()
    elif damage == "no_tokenizer":
        (model / "tokenizer.json").unlink()
    elif damage == "no_weights":
        for f in model.glob("model*.safetensors*"):
            f.unlink()
    err = setup_run(tmp_path / "run", "model.init=pretrained", f"model.path={model}")
    assert err is not None and needle in str(err), err


def test_tokenizer_larger_than_the_model_vocabulary_fails_before_work(tmp_path, sharded_model):
    from rlrepro.model import Qwen3ForCausalLM, init_random_weights, save_pretrained
    from rlrepro.model.tiny import tiny_config

    model = tmp_path / "small_vocab"  # weights for 40 tokens, next to the tiny model's larger tokenizer
    save_pretrained(init_random_weights(Qwen3ForCausalLM(tiny_config(40)), 0), model, tokenizer_from=sharded_model)
    err = setup_run(tmp_path / "run", "model.init=pretrained", f"model.path={model}")
    assert isinstance(err, ConfigError)
    assert "vocab_size is 40" in str(err) and "tokenizer" in str(err)


# -------------------------------------------------------------------------------------------------- rewards

REWARD_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), st.booleans(), st.none(),
    st.text(max_size=3), st.lists(st.floats(0, 1), max_size=2), st.just("raise"))


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("reward") / "run"
    run.mkdir()
    return run


def _valid(v) -> bool:
    return (not isinstance(v, bool) and isinstance(v, (int, float)) and v == v and 0 <= v <= 1)


@settings(HSET, max_examples=40)
@given(value=REWARD_VALUES, policy=st.sampled_from(["raise", "zero"]))
def test_rewards_that_raise_or_return_non_numbers(reward_run, monkeypatch, value, policy):
    mod = types.ModuleType("rlrepro_test_bad_reward")

    def reward(completion, record):
        if value == "raise":
            raise RuntimeError("boom")
        return value

    mod.reward = reward
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    run = reward_run  # shared: its base_model and data are made once
    (run / "config.yaml").write_text("# the earlier run's config\n")
    err = setup_run(run, f"reward.fn={mod.__name__}:reward", f"reward.on_error={policy}")
    if policy == "zero" or _valid(value):
        assert err is None, err
    else:
        assert isinstance(err, ConfigError), err
        assert "reward.fn='rlrepro_test_bad_reward:reward'" in str(err) and "reward.on_error=zero" in str(err)
        assert (run / "config.yaml").read_text() == "# the earlier run's config\n"


# ----------------------------------------------------------------------------------------- the run directory

def test_a_fresh_run_refuses_a_directory_that_holds_a_run(existing_run, capsys):
    before = tree_digest(existing_run)
    assert main(["train", "recipe=grpo_tiny", *COMMON, f"run.dir={existing_run}"]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "run.resume=true" in err and "run.overwrite=true" in err
    assert unchanged(existing_run, before)


def test_overwrite_deletes_only_the_runs_own_files(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000001.tmp-1").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    (run / "notes.txt").write_text("mine")
    assert setup_run(run, "run.resume=false", "run.overwrite=true") is None
    assert (run / "notes.txt").read_text() == "mine"
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    assert (run / "config.yaml").exists() and (run / "base_model" / "config.json").exists()

"""inputs.json: the run's inputs (data, tokenizer, starting weights, environment, versions) as part of its record,
and ``rlrepro diff`` naming their differences first."""
import hashlib
import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from rlrepro.repro.diff import diff_runs, main_diff
from rlrepro.repro.inputs import (CODE_KEY, INPUTS_FILE, INPUTS_FORMAT, code_digest, collect_inputs, compare_inputs,
                                  input_differences, read_inputs, rlrepro_code, write_inputs)
from rlrepro.repro.records import ReproError
from test_repro_diff import make_run


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def env(monkeypatch):
    """A clean environment: none of the knobs that collect_inputs records is inherited from the test process."""
    for k in list(os.environ):
        if k.startswith(("RLREPRO_", "NCCL_")) or k in ("CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED",
                                                         "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"):
            monkeypatch.delenv(k)
    return monkeypatch


@pytest.fixture
def setup(tmp_path):
    """A small model directory (tokenizer files and a weight file that is not a tokenizer file) and a data file."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "b", "chat_template": "{{ x }}"}))
    (model / "merges.txt").write_text("a b\n")
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    data = tmp_path / "data" / "gsm8k.jsonl"
    data.parent.mkdir()
    data.write_text('{"question": "1+1", "answer": "2"}\n{"question": "2+2", "answer": "4"}\n')
    return model, data


def collect(model, data, **kw):
    args = dict(data_files=[data], records_digest="r" * 64, data_revision=None, model_dir=model,
                weights_digest="w" * 64)
    args.update(kw)
    return collect_inputs(**args)


def test_collect_records_every_input(env, setup):
    model, data = setup
    env.setenv("RLREPRO_ATTENTION_BWD", "torch")
    env.setenv("NCCL_ALGO", "Ring")
    env.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env.setenv("PYTHONHASHSEED", "0")
    env.setenv("RLREPRO_STACK_DUMP_S", "30")
    env.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    env.setenv("SOME_OTHER_VARIABLE", "x")
    rec = collect(model, data, data_revision="v1.2")
    assert rec["format"] == INPUTS_FORMAT
    assert rec["data"]["files"] == {"gsm8k.jsonl": sha(data)}
    assert rec["data"]["records_digest"] == "r" * 64 and rec["data"]["revision"] == "v1.2"
    assert rec["weights_digest"] == "w" * 64
    assert rec["tokenizer"]["files"] == {n: sha(model / n) for n in ("merges.txt", "tokenizer.json",
                                                                      "tokenizer_config.json")}
    assert rec["env"] == {"RLREPRO_ATTENTION_BWD": "torch", "NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                          "PYTHONHASHSEED": "0"}
    assert rec["env_informational"] == {"RLREPRO_STACK_DUMP_S": "30", "CUDA_VISIBLE_DEVICES": "0,1"}
    v = rec["versions"]
    assert v["python"] == platform.python_version() and v["torch"] == torch.__version__
    assert v["cuda"] == torch.version.cuda and v["rlrepro"] == __import__("rlrepro").__version__
    assert rec["gpu"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    json.dumps(rec)  # plain JSON
    assert collect(model, data, data_revision="v1.2") == rec  # a pure function of the inputs
    assert compare_inputs(rec, collect(model, data, data_revision="v1.2")) == []


def test_chat_template_files_and_explicit_tokenizer_files(env, setup):
    model, data = setup
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m }}{% endfor %}")
    (model / "additional_chat_templates").mkdir()
    (model / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    files = collect(model, data)["tokenizer"]["files"]
    assert files["chat_template.jinja"] == sha(model / "chat_template.jinja")
    assert files["tool_use.jinja"] == sha(model / "additional_chat_templates" / "tool_use.jinja")
    assert "config.json" not in files and "model.safetensors" not in files
    only = collect(model, data, tokenizer_files=[model / "tokenizer.json"])["tokenizer"]["files"]
    assert only == {"tokenizer.json": sha(model / "tokenizer.json")}


def test_data_directories_and_files_of_one_name(env, setup, tmp_path):
    model, data = setup
    other = tmp_path / "other" / "gsm8k.jsonl"
    other.parent.mkdir()
    other.write_text("{}\n")
    files = collect(model, data, data_files=[data, other])["data"]["files"]
    assert files == {str(data): sha(data), str(other): sha(other)}  # both kept, named by their paths
    d = tmp_path / "hfdata"
    (d / "train").mkdir(parents=True)
    (d / "train" / "part0.arrow").write_bytes(b"abc")
    before = collect(model, data, data_files=[d])["data"]["files"]["hfdata"]
    (d / "train" / "part0.arrow").write_bytes(b"abd")
    assert collect(model, data, data_files=[d])["data"]["files"]["hfdata"] != before
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        collect(model, data, data_files=[tmp_path / "nope.jsonl"])


def flip_last_byte(path):
    b = bytearray(path.read_bytes())
    b[-2] ^= 1
    path.write_bytes(bytes(b))


def test_a_changed_data_byte_is_named(env, setup):
    model, data = setup
    a = collect(model, data)
    flip_last_byte(data)
    b = collect(model, data)
    assert a["data"]["files"]["gsm8k.jsonl"] != b["data"]["files"]["gsm8k.jsonl"]
    ha, hb = a["data"]["files"]["gsm8k.jsonl"], b["data"]["files"]["gsm8k.jsonl"]
    assert compare_inputs(a, b) == [f"data file gsm8k.jsonl changed (sha256 {ha[:12]}... vs {hb[:12]}...)"]
    assert [d.bits for d in input_differences(a, b)] == [True]


def test_a_changed_tokenizer_byte_is_named(env, setup):
    model, data = setup
    a = collect(model, data)
    flip_last_byte(model / "tokenizer_config.json")
    b = collect(model, data)
    msgs = compare_inputs(a, b)
    assert len(msgs) == 1 and msgs[0].startswith("tokenizer file tokenizer_config.json changed (sha256 ")
    (model / "merges.txt").unlink()
    assert "tokenizer file merges.txt is in A only" in compare_inputs(a, collect(model, data))


def test_an_attention_backward_override_is_named(env, setup):
    model, data = setup
    a = collect(model, data)
    env.setenv("RLREPRO_ATTENTION_BWD", "torch")
    b = collect(model, data)
    assert compare_inputs(a, b) == ["RLREPRO_ATTENTION_BWD differs: unset vs 'torch'"]
    assert compare_inputs(b, a) == ["RLREPRO_ATTENTION_BWD differs: 'torch' vs unset"]
    assert input_differences(b, a)[0].bits


def test_the_flashinfer_version_is_recorded_where_installed_and_named(env, setup, monkeypatch):
    """flashinfer's kernels give the fast mode's and RLREPRO_ATTENTION=fa3's bits: its version is an input where it
    is installed; where it is not, the record has no key (and older records, which have none, compare equal)."""
    from rlrepro.repro import inputs as I
    model, data = setup
    real = I._dist_version
    monkeypatch.setattr(I, "_dist_version", lambda name: None if name == "flashinfer-python" else real(name))
    a = collect(model, data)
    assert "flashinfer" not in a["versions"]
    monkeypatch.setattr(I, "_dist_version", lambda name: "0.5.3" if name == "flashinfer-python" else real(name))
    b = collect(model, data)
    assert b["versions"]["flashinfer"] == "0.5.3"
    (d,) = input_differences(a, b)
    assert d.bits and d.message == ("flashinfer version differs: none vs 0.5.3 (its kernels run in the fast mode "
                                    "and with RLREPRO_ATTENTION=fa3)")
    assert compare_inputs(b, collect(model, data)) == []


def test_informational_variables_are_named_as_such(env, setup):
    model, data = setup
    a = collect(model, data)
    env.setenv("RLREPRO_DEBUG", "1")
    b = collect(model, data)
    (d,) = input_differences(a, b)
    assert not d.bits and d.message == "RLREPRO_DEBUG differs: unset vs '1' (informational: cannot change bits)"


def test_other_inputs_are_named(env, setup):
    model, data = setup
    a = collect(model, data)
    b = json.loads(json.dumps(a))
    b["versions"]["torch"], b["gpu"], b["weights_digest"] = "2.11.0", "NVIDIA H200", "v" * 64
    b["data"]["records_digest"], b["data"]["revision"] = "s" * 64, "main"
    msgs = compare_inputs(a, b)
    assert f"torch version differs: {torch.__version__} vs 2.11.0" in msgs
    assert "starting weights differ (weights digest wwwwwwwwwwww... vs vvvvvvvvvvvv...)" in msgs
    assert "data records differ (digest rrrrrrrrrrrr... vs ssssssssssss...)" in msgs
    assert "data revision differs: unset vs 'main'" in msgs
    assert any(m.startswith("GPU differs: ") and m.endswith(" vs NVIDIA H200") for m in msgs)
    assert len(msgs) == 5


def test_the_cpu_and_its_kernel_capability_are_named(env, setup):
    # grpo_tiny on one machine under ATEN_CPU_CAPABILITY=avx2 diverges from its AVX512 run at step 1 (rollout
    # logprobs), yet its inputs said "same": the CPU's kernel capability and the variables that pick it are inputs
    model, data = setup
    a = collect(model, data)
    assert a["cpu"]["capability"] == torch.backends.cpu.get_cpu_capability() and a["cpu"]["model"]
    b = json.loads(json.dumps(a))
    b["cpu"]["capability"] = "AVX2" if a["cpu"]["capability"] != "AVX2" else "AVX512"
    (d,) = input_differences(a, b)
    assert d.bits and d.message == f"CPU kernel capability differs: {a['cpu']['capability']} vs {b['cpu']['capability']}"
    b["gpu"] = a["gpu"] = "NVIDIA H200"  # a GPU run's numbers are the GPU's: the CPU is informational there
    (d,) = input_differences(a, b)
    assert not d.bits and d.message.endswith("(informational for GPU runs)")
    env.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert collect(model, data)["env"] == {"ATEN_CPU_CAPABILITY": "avx2"}
    del b["cpu"]  # a run recorded before the entry: nothing to say
    assert [x.what for x in input_differences(a, b)] == []


def test_write_and_read(env, setup, tmp_path):
    model, data = setup
    run = tmp_path / "run"
    assert read_inputs(run) is None  # no run dir, no inputs.json: an older run
    rec = collect(model, data)
    path = write_inputs(run, rec)
    assert path == run / INPUTS_FILE and read_inputs(run) == rec
    assert sorted(p.name for p in run.iterdir()) == [INPUTS_FILE]  # no temporary file left
    write_inputs(run, {**rec, "weights_digest": "x"})  # replaced whole
    assert read_inputs(run)["weights_digest"] == "x"
    path.write_text("{not json")
    with pytest.raises(ReproError, match="inputs.json: not valid JSON"):
        read_inputs(run)
    path.write_text(json.dumps({"format": "rlrepro.inputs.v999"}))
    with pytest.raises(ReproError, match="unknown format"):
        read_inputs(run)


def test_the_module_does_not_import_torch():
    code = "import sys, rlrepro.repro.inputs, rlrepro.repro.diff; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------------------ rlrepro diff


def two_runs(tmp_path, env, setup, *, mutate=None):
    model, data = setup
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b", mutate=mutate)
    write_inputs(a, collect(model, data))
    env.setenv("RLREPRO_ATTENTION_BWD", "torch")
    flip_last_byte(data)
    write_inputs(b, collect(model, data))
    return a, b


def test_diff_names_the_input_differences_first(tmp_path, env, setup, capsys):
    a, b = two_runs(tmp_path, env, setup)
    rep = diff_runs(a, b)
    assert rep.inputs_compared and rep.verdict == "identical"  # the records decide the verdict
    assert [(d.what, d.key) for d in rep.input_diffs] == [("data_file", "gsm8k.jsonl"),
                                                          ("env", "RLREPRO_ATTENTION_BWD")]
    assert main_diff([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert out.index("inputs: 2 difference(s)") < out.index("config:")
    assert "  data file gsm8k.jsonl changed (sha256 " in out
    assert "  RLREPRO_ATTENTION_BWD differs: unset vs 'torch'" in out
    assert "verdict: IDENTICAL (although inputs that can change bits differ)" in out
    assert main_diff([str(a), str(b), "--strict"]) == 0           # --strict is about the steps recorded
    assert main_diff([str(a), str(b), "--strict-inputs"]) == 1
    capsys.readouterr()
    assert main_diff([str(a), str(b), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["inputs_compared"] and report["inputs_differ_in_bits"]
    assert [d["message"] for d in report["input_diffs"]] == [d.message for d in rep.input_diffs]
    assert report["input_diffs"][1] == {"what": "env", "key": "RLREPRO_ATTENTION_BWD", "a": None, "b": "torch",
                                        "bits": True, "message": "RLREPRO_ATTENTION_BWD differs: unset vs 'torch'"}


def test_diff_names_what_a_resume_recorded_of_its_inputs(tmp_path, env, setup, capsys):
    """A resume (or ``verify --from-step``) with other inputs than the first start keeps the first start's record
    and appends the differences to its ``resumes``: diff names them, and --strict-inputs fails on bit-relevant
    ones, although the top-level records are equal."""
    from rlrepro.orchestration.resume_checks import record_resumed_inputs
    model, data = setup
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    first = collect(model, data)
    write_inputs(a, first)
    write_inputs(b, first)
    assert diff_runs(a, b).input_diffs == []
    env.setenv("RLREPRO_ATTENTION_BWD", "torch")
    said = []
    record_resumed_inputs(b, first, collect(model, data), 3, say=said.append)
    assert said and "RLREPRO_ATTENTION_BWD" in said[0]
    rep = diff_runs(a, b)
    assert [(d.what, d.key, d.bits) for d in rep.input_diffs] == [("env", "RLREPRO_ATTENTION_BWD", True)]
    assert rep.input_diffs[0].message.startswith("run B resumed at step 3 with other inputs")
    assert main_diff([str(a), str(b), "--strict-inputs"]) == 1
    assert "run B resumed at step 3" in capsys.readouterr().out


def test_diff_of_diverged_runs_prints_the_inputs_before_the_divergence(tmp_path, env, setup, capsys):
    def mutate(step, samples, weights):
        if step >= 3:
            samples[2]["token_ids"][4] += 1
    a, b = two_runs(tmp_path, env, setup, mutate=mutate)
    assert main_diff([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert out.index("RLREPRO_ATTENTION_BWD differs") < out.index("FIRST DIVERGENCE: step 3")


def test_informational_differences_do_not_fail_strict_inputs(tmp_path, env, setup, capsys):
    model, data = setup
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    write_inputs(a, collect(model, data))
    env.setenv("RLREPRO_STACK_DUMP_S", "60")
    write_inputs(b, collect(model, data))
    assert main_diff([str(a), str(b), "--strict-inputs"]) == 0
    out = capsys.readouterr().out
    assert "RLREPRO_STACK_DUMP_S differs: unset vs '60' (informational" in out and "verdict: IDENTICAL\n" in out


def test_runs_without_inputs_diff_as_before(tmp_path, env, setup, capsys):
    model, data = setup
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    assert main_diff([str(a), str(b)]) == 0
    before = capsys.readouterr().out
    rep = diff_runs(a, b)
    assert not rep.inputs_compared and rep.input_diffs == [] and "inputs:" not in before and INPUTS_FILE not in before
    # --strict-inputs asks for the inputs to be shown equal: records without them cannot pass it
    assert main_diff([str(a), str(b), "--strict-inputs"]) == 1
    assert "--strict-inputs: inputs not compared: no inputs.json in either run" in capsys.readouterr().out
    write_inputs(a, collect(model, data))
    assert main_diff([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "note: inputs not compared: no inputs.json in run B" in out
    assert main_diff([str(a), str(b), "--strict-inputs"]) == 1
    out = capsys.readouterr().out
    assert "--strict-inputs: inputs not compared: no inputs.json in run B" in out
    assert "verdict: IDENTICAL; exit 1: --strict-inputs failed" in out
    assert main_diff([str(b), str(a), "--strict-inputs", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["strict_failures"] == [
        "--strict-inputs: inputs not compared: no inputs.json in run A"]
    write_inputs(b, collect(model, data))
    assert main_diff([str(a), str(b)]) == 0
    assert "inputs: same (inputs.json" in capsys.readouterr().out
    (b / INPUTS_FILE).write_text("[]")
    # a corrupt (or another version's) inputs.json cannot decide the verdict: the records are compared, the inputs
    # are "not compared" (a note), and --strict-inputs fails (session 31; before: exit 2, nothing compared)
    assert main_diff([str(a), str(b)]) == 0
    assert f"note: inputs not compared: run B: {b / INPUTS_FILE}: expected a JSON object" in capsys.readouterr().out
    assert main_diff([str(a), str(b), "--strict-inputs"]) == 1


def test_the_held_out_set_is_recorded_and_a_changed_byte_is_named(env, setup, tmp_path):
    model, data = setup
    assert "eval" not in collect(model, data)  # a run that does not evaluate records no eval entry
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text('{"question": "3+3", "answer": "6"}\n')
    a = collect(model, data, eval_files=[held_out])
    assert a["eval"]["files"] == {"held_out.jsonl": sha(held_out)}
    flip_last_byte(held_out)
    b = collect(model, data, eval_files=[held_out])
    ha, hb = a["eval"]["files"]["held_out.jsonl"], b["eval"]["files"]["held_out.jsonl"]
    assert compare_inputs(a, b) == [f"eval file held_out.jsonl changed (sha256 {ha[:12]}... vs {hb[:12]}...)"]
    # the held-out set changes eval/* metrics, never a training bit: not an input that can change bits
    assert [d.bits for d in input_differences(a, b)] == [False]
    assert [(d.what, d.bits) for d in input_differences(a, collect(model, data))] == [("eval_file", False)]


def test_the_users_reward_and_environment_code_is_recorded_and_a_change_named(env, setup, tmp_path, monkeypatch):
    """reward.fn / env.fn outside rlrepro: the file each was defined in and its sha256 (a one-character change in
    the user's module changes bits, so diff names it); rlrepro's built-ins are left out."""
    import importlib
    import sys as _sys

    from rlrepro.data import load_reward_fn

    model, data = setup
    mod = tmp_path / "my_reward_h.py"
    mod.write_text("def reward(completion, record):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = importlib.import_module("my_reward_h").reward
    a = collect(model, data, code={"reward.fn": fn, "env.fn": load_reward_fn("exact_match")})
    assert a["code"] == {"reward.fn": {"file": str(mod.resolve()), "sha256": sha(mod)}}  # the built-in left out
    mod.write_text("def reward(completion, record):\n    return 0.0\n")
    b = collect(model, data, code={"reward.fn": fn})
    diffs = [d for d in input_differences(a, b) if d.what == "code"]
    assert [(d.key, d.bits) for d in diffs] == [("reward.fn", True)]
    assert compare_inputs(a, b)[0].startswith("the code of reward.fn changed (sha256 ")
    _sys.modules.pop("my_reward_h", None)


def test_verify_and_eval_work_in_the_runs_launch_directory(env, setup, tmp_path, monkeypatch, capsys):
    """inputs.json records where the run was started; rlrepro verify / eval started elsewhere move there, so that
    config.yaml's relative data.source and a reward.fn module next to it resolve as in the run."""
    from rlrepro.repro.inputs import enter_launch_dir

    model, data = setup
    launch, elsewhere, run = tmp_path / "project", tmp_path / "elsewhere", tmp_path / "project" / "runs" / "r"
    for d in (launch, elsewhere, run):
        d.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(launch)
    write_inputs(run, collect(model, data))
    assert read_inputs(run)["launch_dir"] == str(launch)
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert enter_launch_dir("../project/runs/r") == str(run.resolve())  # the run's path, resolved first
    assert os.getcwd() == str(launch) and sys.path[-1] == str(launch)
    assert "launch directory" in capsys.readouterr().err
    assert enter_launch_dir(str(run)) == str(run.resolve()) and capsys.readouterr().err == ""  # already there
    from rlrepro.repro.inputs import in_launch_dir
    monkeypatch.chdir(elsewhere)
    with in_launch_dir(str(run)) as path:  # what verify and eval use: the directory is put back after
        assert path == str(run.resolve()) and os.getcwd() == str(launch)
    assert os.getcwd() == str(elsewhere)


# ------------------------------------------------------------------------------------- rlrepro's own code


def test_code_digest_is_the_documented_hash_of_the_package_sources(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub" / "__pycache__").mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / "sub" / "mod.py").write_bytes(b"def f():\n    return 2\n")
    (pkg / "sub" / "__pycache__" / "mod.cpython-311.py").write_text("ignored")
    (pkg / "notes.txt").write_text("not source")
    h = hashlib.sha256(b"rlrepro.code_sha256.v1\0")
    for rel in ("__init__.py", "sub/mod.py"):
        data = (pkg / rel).read_bytes()
        h.update(rel.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    assert code_digest(pkg) == (h.hexdigest(), 2)
    (pkg / "sub" / "__pycache__" / "mod.cpython-311.py").write_text("changed")
    (pkg / "notes.txt").write_text("changed")
    assert code_digest(pkg) == (h.hexdigest(), 2)
    (pkg / "sub" / "mod.py").write_bytes(b"def f():\n    return 3\n")  # one byte of source
    assert code_digest(pkg)[0] != h.hexdigest()
    assert rlrepro_code(pkg)["git_commit"] is None  # not a git checkout


def test_inputs_record_rlrepro_code_and_diff_names_a_change(tmp_path, env, setup, capsys):
    model, data = setup
    rec = collect(model, data)
    assert rec[CODE_KEY]["sha256"] == code_digest()[0] and rec[CODE_KEY]["files"] == code_digest()[1]
    assert rec["versions"]["rlrepro"] == __import__("rlrepro").__version__
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    write_inputs(a, rec)
    changed = json.loads(json.dumps(rec))
    changed[CODE_KEY]["sha256"] = "0" * 64   # another rlrepro source, same version string
    write_inputs(b, changed)
    rep = diff_runs(a, b)
    assert [(d.what, d.key, d.bits) for d in rep.input_diffs] == [(CODE_KEY, "sha256", True)]
    assert rep.input_diffs[0].message.startswith(f"rlrepro code differs (sha256 of its source "
                                                 f"{rec[CODE_KEY]['sha256'][:12]}... vs 000000000000...")
    assert main_diff([str(a), str(b)]) == 0
    assert "rlrepro code differs" in capsys.readouterr().out
    assert main_diff([str(a), str(b), "--strict-inputs"]) == 1
    # the same source under another commit: informational
    other = json.loads(json.dumps(rec))
    other[CODE_KEY]["git_commit"] = "f" * 40
    write_inputs(b, other)
    rep = diff_runs(a, b)
    if rec[CODE_KEY]["git_commit"] != "f" * 40:
        assert [(d.what, d.key, d.bits) for d in rep.input_diffs] == [(CODE_KEY, "git_commit", False)]
    assert main_diff([str(a), str(b), "--strict-inputs"]) == 0


def test_a_run_recorded_before_the_code_digest_still_diffs(tmp_path, env, setup, capsys):
    model, data = setup
    rec = collect(model, data)
    old = {k: v for k, v in rec.items() if k != CODE_KEY}
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    write_inputs(a, old)
    write_inputs(b, rec)
    rep = diff_runs(a, b)
    assert rep.inputs_compared and rep.input_diffs == [] and rep.verdict == "identical"
    assert len(rep.inputs_not_compared) == 1 and rep.inputs_not_compared[0].startswith(
        "code digest not recorded in run A")
    assert main_diff([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "  not compared: code digest not recorded in run A" in out
    assert main_diff([str(a), str(b), "--strict-inputs"]) == 1
    assert "--strict-inputs: inputs not compared: code digest not recorded in run A" in capsys.readouterr().out
    write_inputs(b, old)
    assert diff_runs(a, b).inputs_not_compared[0].startswith("code digest not recorded in either run")

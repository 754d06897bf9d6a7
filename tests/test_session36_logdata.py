"""Session 36: a killed run's wandb rows are not logged twice on resume, none is lost; a model directory's chat
templates are found where transformers finds them (chat_template.jinja, additional_chat_templates/*.jinja, the
"tool_use" one when tools are given); the documented rule for a text value that is the JSON text of chat turns."""
import json
import os
import signal
import struct
import subprocess
import sys
import time
import types
import zlib
from pathlib import Path

import pytest

from rlrepro.orchestration.config import LoggerConfig, RunConfig, RunSchema
from rlrepro.orchestration.runlog import WANDB_ID_FILE, RunLog

REPO = Path(__file__).resolve().parents[1]
RUN_ID = "abcd1234"


# ------------------------------------------------------------------------------- wandb: a killed run, resumed
def _cfg(run_dir, resume):
    return RunSchema(logger=LoggerConfig(wandb=True, progress=True, num_table_samples=0, mode="offline"),
                     run=RunConfig(dir=str(run_dir), resume=resume))


def _wandb_file(records: list[bytes], torn: bytes = b"") -> bytes:
    """A ``.wandb`` transaction log holding ``records`` (leveldb log format), every record split in chunks where
    it crosses a 32 KiB block; ``torn``: the first chunk of a record whose rest was never written (a kill)."""
    out = bytearray(b":W&B\xe1\xbe\x00")

    def chunk(kind, data):
        out.extend(struct.pack("<IHB", zlib.crc32(data), len(data), kind) + data)

    for data in records:
        first = True
        while True:
            left = 32768 - len(out) % 32768
            if left < 7:
                out.extend(b"\0" * left)
                continue
            part, data = data[:left - 7], data[left - 7:]
            chunk((1 if first else 4) if not data else (2 if first else 3), part)
            first = False
            if not data:
                break
    if torn:
        chunk(2, torn)
    return bytes(out)


def _history_record(step: int, pad: int = 0) -> bytes:
    from wandb.proto import wandb_internal_pb2 as pb

    r = pb.Record()
    r.history.item.add(key="_step", value_json=str(step))
    r.history.item.add(key="train/loss", value_json=json.dumps(0.5 + step))
    r.history.item.add(key="pad", value_json=json.dumps("x" * pad))
    return r.SerializeToString()


class _Run:
    def __init__(self, calls, run_dir):
        self.calls, self.step = calls, 0
        (Path(run_dir) / "wandb" / "offline-run-20990101_000000-new").mkdir(parents=True, exist_ok=True)
        self.dir = str(Path(run_dir) / "wandb" / "offline-run-20990101_000000-new" / "files")

    def log(self, payload, step=None, **kwargs):
        self.calls.append(step)

    def finish(self, *a, **k):
        pass


@pytest.fixture
def fake_wandb(monkeypatch):
    """wandb.init and the run replaced (offline, wandb's step starting at 0); wandb.proto stays the real one."""
    pytest.importorskip("wandb.proto.wandb_internal_pb2")
    calls = []
    mod = types.ModuleType("wandb")
    mod.init = lambda **kw: _Run(calls, kw["dir"])
    mod.Table, mod.define_metric = None, lambda *a, **k: None
    mod.__path__ = sys.modules["wandb"].__path__ if "wandb" in sys.modules else []
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return calls


def _killed_leg(run_dir: Path, steps: int, *, pad: int = 0, torn: bytes = b"") -> None:
    """What a killed first invocation leaves: the wandb id recorded, its offline directory holding the rows of
    ``steps`` steps that wandb wrote before the kill, no step file (the wandb run was never closed)."""
    wandb_dir = run_dir / "wandb"
    (wandb_dir / f"offline-run-20260101_000000-{RUN_ID}").mkdir(parents=True)
    (wandb_dir / WANDB_ID_FILE).write_text(RUN_ID + "\n")
    data = _wandb_file([_history_record(s, pad) for s in range(1, steps + 1)], torn)
    (wandb_dir / f"offline-run-20260101_000000-{RUN_ID}" / f"run-{RUN_ID}.wandb").write_bytes(data)


@pytest.mark.parametrize("pad", [0, 20000])  # rows in one block; rows chunked across blocks
def test_a_killed_runs_rows_on_disk_are_not_logged_again(tmp_path, fake_wandb, capsys, pad):
    """Old code: only a closed run wrote the step file, so a resume from step 2's checkpoint after a kill at step 5
    logged steps 3-5 again (wandb rows held twice after `wandb sync`). A torn last record does not count."""
    _killed_leg(tmp_path, 5, pad=pad, torn=_history_record(6)[:9])
    log = RunLog(_cfg(tmp_path, resume=True), tmp_path)
    log.start(2)
    for step in range(3, 9):
        log.log_wandb(step, {"step": step})
    log.close()
    assert fake_wandb == [6, 7, 8]
    assert "wandb run already holds steps up to 5" in capsys.readouterr().err
    assert (tmp_path / "wandb" / "rlrepro_logged_step").read_text() == f"{RUN_ID} 8\n"


def test_rows_wandb_did_not_write_before_the_kill_are_logged_on_resume(tmp_path, fake_wandb):
    """The run logged steps 1-5 but wandb had written only 1-2 when it was killed (its writer keeps the last block
    in memory): 3-5 are logged by the resumed run, not skipped (they would be lost)."""
    _killed_leg(tmp_path, 2)
    log = RunLog(_cfg(tmp_path, resume=True), tmp_path)
    log.start(2)
    for step in range(3, 7):
        log.log_wandb(step, {"step": step})
    log.close()
    assert fake_wandb == [3, 4, 5, 6]


def test_a_fresh_run_ignores_the_killed_runs_rows(tmp_path, fake_wandb):
    _killed_leg(tmp_path, 5)
    log = RunLog(_cfg(tmp_path, resume=False), tmp_path)
    log.start(0)
    for step in (1, 2):
        log.log_wandb(step, {"step": step})
    log.close()
    assert fake_wandb == [1, 2]


def test_a_damaged_wandb_file_logs_every_step_again(tmp_path, fake_wandb):
    _killed_leg(tmp_path, 0)
    (tmp_path / "wandb" / f"offline-run-20260101_000000-{RUN_ID}" / f"run-{RUN_ID}.wandb").write_bytes(b"junk" * 9)
    log = RunLog(_cfg(tmp_path, resume=True), tmp_path)
    log.start(0)
    for step in (1, 2):
        log.log_wandb(step, {"step": step})
    log.close()
    assert fake_wandb == [1, 2]


# real wandb (offline), a real kill: SIGKILL of the process that logs
_LEG = """
import os, signal, sys
from pathlib import Path
from rlrepro.orchestration.config import LoggerConfig, RunConfig, RunSchema
from rlrepro.orchestration.runlog import RunLog
run_dir, resume, first, last, kill = Path(sys.argv[1]), sys.argv[2] == "1", *map(int, sys.argv[3:6])
cfg = RunSchema(logger=LoggerConfig(wandb=True, progress=False, num_table_samples=0, mode="offline"),
                run=RunConfig(dir=str(run_dir), resume=resume))
log = RunLog(cfg, run_dir)
log.start(first - 1)
for step in range(first, last + 1):
    log.log_wandb(step, {"step": step, **{f"train/m{i}": step + i / 1000 for i in range(100)}})
if kill:
    os.kill(os.getpid(), signal.SIGKILL)
log.close()
"""


def _leg(run_dir, resume, first, last, kill):
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="offline", HF_HUB_OFFLINE="1", WANDB_SILENT="true")
    # each leg its own wandb service: an earlier test's wandb.init in this process left WANDB_SERVICE set, and a
    # leg attached to that service finds the killed leg's run still open there ("run ID ... is in use")
    env.pop("WANDB_SERVICE", None)
    p = subprocess.run([sys.executable, "-c", _LEG, str(run_dir), str(int(resume)), str(first), str(last),
                        str(int(kill))], env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == (-signal.SIGKILL if kill else 0), p.stderr[-3000:]


def test_real_wandb_killed_then_resumed_holds_each_step_once(tmp_path):
    """Real wandb 0.2x/0.3x, offline: the first leg logs steps 1-60 and is SIGKILLed (wandb writes whole 32 KiB
    blocks, so some of its last rows never reach the disk); the resumed leg restarts from step 2's checkpoint.
    Across both offline directories (what `wandb sync` uploads) every step is held exactly once (old code: the
    rows the killed leg wrote from step 3 on were held twice)."""
    pytest.importorskip("wandb")
    from test_session34_wandb import _wandb_history

    _leg(tmp_path, False, 1, 60, kill=True)
    wandb_file = next(tmp_path.glob("wandb/offline-run-*/*.wandb"))
    for _ in range(50):  # wandb's own process may still be writing what it had received
        size = wandb_file.stat().st_size
        time.sleep(0.2)
        if wandb_file.stat().st_size == size:
            break
    first = [row["_step"] for row in _wandb_history(tmp_path)]
    assert first and first == list(range(1, len(first) + 1)) and len(first) < 60  # the test's premise
    _leg(tmp_path, True, 3, 65, kill=False)
    assert [row["_step"] for row in _wandb_history(tmp_path)] == list(range(1, 66))


# ------------------------------------------------------------------------------- chat templates of a model dir
DEFAULT_T = "D{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
TOOL_T = "T{{ tools | length }}{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
OTHER_T = "O{% for m in messages %}{{ m.content }}{% endfor %}"
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "d", "parameters": {}}}]
MSGS = [{"role": "user", "content": "2+2?"}]


def _model(tmp_path, *, jinja=None, extra=None, config_template="keep"):
    """The tiny model directory with ``chat_template.jinja``, ``additional_chat_templates/NAME.jinja`` and
    tokenizer_config.json's ``chat_template`` as given ("keep": the tiny model's own, None: removed)."""
    from rlrepro.model import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "m")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    if config_template is None:
        cfg.pop("chat_template", None)
    elif config_template != "keep":
        cfg["chat_template"] = config_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    for name, text in (extra or {}).items():
        (path / "additional_chat_templates").mkdir(exist_ok=True)
        (path / "additional_chat_templates" / f"{name}.jinja").write_text(text)
    return path


def _hf(path, tools):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    return hf.apply_chat_template(MSGS, tools=tools, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_additional_chat_templates_tool_use_renders_with_tools_as_in_transformers(tmp_path, tools):
    """Old code read chat_template.jinja only: with tools it rendered the default, not
    additional_chat_templates/tool_use.jinja as transformers does."""
    from rlrepro.model import load_tokenizer

    path = _model(tmp_path, jinja=DEFAULT_T, extra={"tool_use": TOOL_T, "other": OTHER_T})
    tok = load_tokenizer(path)
    ours = tok.apply_chat_template(MSGS, tools=tools)
    assert ours == ("T1[user:2+2?]" if tools else "D[user:2+2?]")
    assert tok.chat_templates == {"default": DEFAULT_T, "tool_use": TOOL_T, "other": OTHER_T}
    assert ours == _hf(path, tools)


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_tokenizer_config_list_tool_use_renders_with_tools_as_in_transformers(tmp_path, tools):
    """Old code: the list's "default" always, also with tools (transformers picks "tool_use" then)."""
    from rlrepro.model import load_tokenizer

    path = _model(tmp_path, config_template=[{"name": "default", "template": DEFAULT_T},
                                             {"name": "tool_use", "template": TOOL_T}])
    ours = load_tokenizer(path).apply_chat_template(MSGS, tools=tools)
    assert ours == ("T1[user:2+2?]" if tools else "D[user:2+2?]")
    assert ours == _hf(path, tools)


def test_template_files_win_over_tokenizer_config(tmp_path):
    """transformers' precedence: with chat_template.jinja present, tokenizer_config.json's list is not read (its
    "tool_use" neither); without any template the message names both places."""
    from rlrepro.model import load_tokenizer

    path = _model(tmp_path, jinja=DEFAULT_T, config_template=[{"name": "default", "template": OTHER_T},
                                                              {"name": "tool_use", "template": TOOL_T}])
    tok = load_tokenizer(path)
    assert tok.chat_templates == {"default": DEFAULT_T}
    assert tok.apply_chat_template(MSGS, tools=TOOLS) == "D[user:2+2?]" == _hf(path, TOOLS)
    bare = load_tokenizer(_model(tmp_path / "bare", config_template=None))
    with pytest.raises(ValueError, match=r"no chat template \(chat_template.jinja, or chat_template in "
                                         r"tokenizer_config.json\); set data.use_chat_template=false"):
        bare.apply_chat_template(MSGS)


def test_additional_templates_without_a_default_are_refused(tmp_path):
    """Old code ignored additional_chat_templates/ and rendered tokenizer_config.json's template, which
    transformers does not read then (it has templates but no default and refuses to render)."""
    from rlrepro.model import load_tokenizer

    path = _model(tmp_path, extra={"tool_use": TOOL_T})
    with pytest.raises(ValueError) as e:
        load_tokenizer(path)
    assert str(e.value) == (f"{path}/additional_chat_templates holds chat templates ['tool_use'] but none named "
                            f"'default'; add the default one as {path}/chat_template.jinja")


def test_a_model_without_template_files_renders_as_before(tmp_path):
    from rlrepro.model import load_tokenizer
    from rlrepro.model.tiny import CHAT_TEMPLATE

    tok = load_tokenizer(_model(tmp_path))
    assert tok.chat_templates == {"default": CHAT_TEMPLATE} and tok.chat_template == CHAT_TEMPLATE


def test_save_pretrained_keeps_the_named_templates(tmp_path):
    """Old code copied chat_template.jinja but not additional_chat_templates/: a checkpoint or export of the model
    rendered tool prompts with the default template."""
    from rlrepro.model import load_pretrained, load_tokenizer, save_pretrained

    path = _model(tmp_path, jinja=DEFAULT_T, extra={"tool_use": TOOL_T})
    out = save_pretrained(load_pretrained(path), tmp_path / "out")
    assert (out / "additional_chat_templates" / "tool_use.jinja").read_text() == TOOL_T
    assert load_tokenizer(out).apply_chat_template(MSGS, tools=TOOLS) == "T1[user:2+2?]"


# ------------------------------------------------------------------ data: text that is the JSON of chat turns
CHAT_TEXT = '[{"role": "user", "content": "hi"}]'


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_chat_json_text_under_messages_field_is_text_in_a_column_of_strings(tmp_path):
    """The documented rule (docs/DATA.md, "Text beside chat turns"): a string is a plain prompt, as written, also
    when it is the JSON text of chat turns."""
    from rlrepro.data import load_records

    src = _jsonl(tmp_path / "d.jsonl", [{"messages": "plain", "answer": "1"}, {"messages": CHAT_TEXT, "answer": "2"}])
    records, _ = load_records(src, messages_field="messages")
    assert [(r.prompt, r.messages) for r in records] == [("plain", None), (CHAT_TEXT, None)]


def test_chat_json_text_in_a_column_mixing_text_and_lists_is_read_as_turns(tmp_path):
    """The documented exception: datasets stores such a string as the JSON itself (the list's bytes), so in a
    column that also holds lists it is the turns; a string that is not JSON stays a plain prompt."""
    from rlrepro.data import load_records

    rows = [{"messages": [{"role": "user", "content": "a list"}], "answer": "1"},
            {"messages": "plain", "answer": "2"}, {"messages": CHAT_TEXT, "answer": "3"}]
    records, _ = load_records(_jsonl(tmp_path / "d.jsonl", rows), messages_field="messages")
    assert [(r.prompt, r.messages) for r in records] == [
        (None, [{"role": "user", "content": "a list"}]), ("plain", None), (None, [{"role": "user", "content": "hi"}])]


def test_chat_json_text_under_prompt_field_names_how_to_write_turns(tmp_path):
    """Old code's fix named data.messages_field only, which reads a column of such strings as text (the JSON the
    model would see): the fix now says to write them as JSON lists."""
    from rlrepro.data import load_records

    src = _jsonl(tmp_path / "d.jsonl", [{"prompt": "plain", "answer": "1"}, {"prompt": CHAT_TEXT, "answer": "2"}])
    with pytest.raises(ValueError) as e:
        load_records(src)
    assert str(e.value) == (f"{src}: line 2: field 'prompt': expected text, got a list of chat turns (read as "
                            "text, the model would see their JSON). Fix: set data.messages_field=prompt to read "
                            "them as chat turns (a text value there stays a plain prompt; turns written as a JSON "
                            "string stay text there: write them as JSON lists), or set data.on_bad_row=skip to "
                            "leave such rows out (each one is logged).")
    records, _ = load_records(src, on_bad_row="skip")
    assert [r.prompt for r in records] == ["plain"]

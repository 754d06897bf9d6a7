"""The trained policy as a Hugging Face directory: during a run (``checkpoint.export_hf=true``) and after it
(``rlrepro export RUN [--step K] OUT``).

An export is ``RUN/export/step_NNNNNN/`` (or the ``OUT`` given to the command): ``config.json``,
``model.safetensors`` (the policy's state dict in the compute dtype, the very tensors of the checkpoint of that
step), the tokenizer files of the run's model directory and ``generation_config.json`` (the model directory's, else
one with the config's ``bos_token_id`` / ``eos_token_id``). transformers' ``Qwen3ForCausalLM.from_pretrained``,
vLLM and SGLang load it.

Exports live beside ``checkpoints/``, never inside a checkpoint directory, so a checkpoint stays exactly what its
manifest lists. An export directory is complete or absent, as a checkpoint is: it is written into
``NAME.tmp-<pid>/``, every file fsynced, ``config.json`` (the mark of a complete model) written last and atomically,
then renamed into place (an existing one is moved aside first, put back if that rename fails, deleted after it).
``checkpoint.keep_last`` applies to the exports as it does to the checkpoints.

Exporting reads the weights and writes files; it draws no random number and changes no state, so a run with
``checkpoint.export_hf=true`` has the same fingerprints as one without (``tests/test_export.py``).
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import sys
from pathlib import Path

from rlrepro._files import apply_default_mode, fsync_path

from .run_dirs import missing_run_dir

__all__ = ["EXPORT_DIR", "export_path", "list_exports", "finish_export", "new_export_tmp", "prune_exports",
           "export_checkpoint", "main_export", "checkpoint_of"]

EXPORT_DIR = "export"
# tokenizer files save_pretrained does not copy itself (it copies rlrepro.model.checkpoint_io.TOKENIZER_FILES)
_EXTRA_TOKENIZER_FILES = ("added_tokens.json", "tokenizer.model", "chat_template.jinja", "chat_template.json")
_STEP_DIR = re.compile(r"^step_(\d+)$")


def export_path(run_dir: str | os.PathLike, step: int) -> Path:
    """``RUN/export/step_NNNNNN``: where the run's export of ``step`` goes."""
    return Path(run_dir) / EXPORT_DIR / f"step_{step:06d}"


def list_exports(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of each complete export of the run (a ``step_NNNNNN`` holding ``config.json``), oldest
    first."""
    root = Path(run_dir) / EXPORT_DIR
    found = []
    if root.is_dir():
        for d in root.iterdir():
            m = _STEP_DIR.match(d.name)
            if m and d.is_dir() and (d / "config.json").is_file():
                found.append((int(m.group(1)), d))
    return sorted(found)


def new_export_tmp(final: Path, run_owned: bool = False) -> Path:
    """The temporary directory an export of ``final`` is written into. What an earlier export of ``final`` left
    (``final.tmp-<pid>``, or ``final.old-<pid>`` set aside while it replaced ``final``) is cleaned up; nothing else
    in ``final``'s parent is touched (``rlrepro export``'s destination may sit among the user's own folders), unless
    ``run_owned`` (``RUN/export/``, where every step's set-aside copy is the run's)."""
    from rlrepro.trainer.checkpoint import restore_set_aside

    final.parent.mkdir(parents=True, exist_ok=True)
    # an export killed while it replaced another: the old one back
    restore_set_aside(final.parent, name=None if run_owned else final.name)
    for old in final.parent.glob(f"{glob.escape(final.name)}.tmp-*"):
        if old.name.rsplit(".tmp-", 1)[1].isdigit() and old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
    return final.parent / f"{final.name}.tmp-{os.getpid()}"


def _fsync(path: Path) -> None:
    fsync_path(path)


def _generation_config(config: dict) -> dict:
    out = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is not None:
            out[key] = config[key]
    return out


def finish_export(tmp: Path, final: Path, tokenizer_from: str | os.PathLike | None,
                  replace_empty: bool = False) -> Path:
    """Complete the HF directory written into ``tmp`` (the tokenizer files save_pretrained does not copy, a
    ``generation_config.json`` when the model directory has none), fsync it and rename it to ``final``.

    ``config.json`` is what makes a directory a model (and an export complete, :func:`list_exports`), so it is
    written last: taken out, every other file and the directory fsynced, then written back atomically (a temporary
    file, fsynced, renamed, the directory fsynced), and only then is ``tmp`` renamed into place. A power loss
    cannot leave a config.json beside weights that are not on disk. ``replace_empty``: ``final`` is an empty directory
    (the user's, given as OUT) that the export replaces by one rename (refused if something appeared in it
    meanwhile), so that no crash leaves no OUT."""
    tmp, final = Path(tmp), Path(final)
    if not (tmp / "config.json").is_file():
        raise FileNotFoundError(f"the export in {tmp} has no config.json: the trainer did not write it")
    config_bytes = (tmp / "config.json").read_bytes()
    (tmp / "config.json").unlink()  # back below, once everything else is on disk
    _fsync(tmp)  # its removal too, before the data (a crash in between leaves no config.json)
    if tokenizer_from is not None and Path(tokenizer_from).resolve() != tmp.resolve():
        for name in _EXTRA_TOKENIZER_FILES:
            src = Path(tokenizer_from) / name
            if src.is_file() and not (tmp / name).exists():
                shutil.copyfile(src, tmp / name)
                apply_default_mode(tmp / name)
    gen = tmp / "generation_config.json"
    if not gen.is_file():
        config = json.loads(config_bytes.decode("utf-8"))
        gen.write_text(json.dumps(_generation_config(config), indent=2, sort_keys=True) + "\n", encoding="utf-8")
        apply_default_mode(gen)
    from rlrepro.model import write_config_last
    from rlrepro.trainer.checkpoint import commit_checkpoint_dir

    # every file and tmp fsynced, then config.json (fsynced, renamed, tmp fsynced): the marker goes last, as in
    # save_pretrained (one helper for both)
    write_config_last(tmp, config_bytes)

    if replace_empty and final.is_dir() and not final.is_symlink():
        # rename(2) onto an empty directory replaces it in one step (ENOTEMPTY if something appeared in it
        # meanwhile: nothing of the user's is replaced); no moment without OUT, whatever kills the process
        os.rename(tmp, final)
        _fsync(final.parent)
        return final
    commit_checkpoint_dir(tmp, final)  # an existing export is set aside, put back if the rename fails
    return final


def prune_exports(run_dir: str | os.PathLike, keep_last: int, current: int | None = None) -> None:
    """Delete all but the newest ``keep_last`` exports of the run (as checkpoint.keep_last does checkpoints).
    ``current``: the step the run is at; exports of later steps are stale (a run started over in the same
    directory, or steps a resume re-executes, which write the same bits again) and are deleted first, so that
    they can never count among the newest."""
    found = list_exports(run_dir)
    if current is not None:
        for _, path in (e for e in found if e[0] > current):
            shutil.rmtree(path, ignore_errors=True)
        found = [e for e in found if e[0] <= current]
    for _, path in found[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)


def export_run_step(actors, run_dir: str | os.PathLike, step: int, keep_last: int, tokenizer_from) -> Path:
    """During a run: the trainer writes its current weights (those of ``step``) to ``RUN/export/step_NNNNNN``."""
    final = export_path(run_dir, step)
    tmp = new_export_tmp(final, run_owned=True)
    try:
        actors.export_hf(str(tmp))
        finish_export(tmp, final, tokenizer_from)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune_exports(run_dir, keep_last, current=step)
    return final


# ------------------------------------------------------------------------------------------ after the fact

def checkpoint_of(run_dir: Path, step: int | None) -> Path:
    """The directory of the run's complete checkpoint of ``step`` (None: the newest); raises ValueError naming
    the complete ones (and what is wrong with that step's) when there is none."""
    from rlrepro.trainer import list_checkpoints
    from rlrepro.trainer.checkpoint import checkpoint_dir_name, scan_checkpoints

    missing = missing_run_dir("export", Path(run_dir), need_config=False)  # the one wording of every command
    if missing is not None:
        raise ValueError(missing)
    root = run_dir / "checkpoints"
    complete = list_checkpoints(root)
    if step is None:
        if not complete:
            raise ValueError(f"run {run_dir} has no complete checkpoint under {root}; nothing to export")
        return complete[-1][1]
    for s, path in complete:
        if s == step:
            return path
    if step < 1:  # no such directory to name (checkpoint_dir_name(-1) is "step_-00001")
        have = ", ".join(str(s) for s, _ in complete) or "none"
        raise ValueError(f"--step {step}: checkpoints are of steps 1 and up; complete ones of run {run_dir}: {have}")
    problems = {s: problem for s, _, problem in scan_checkpoints(root)}
    have = ", ".join(str(s) for s, _ in complete) or "none"
    why = f" ({problems[step]})" if problems.get(step) else ""
    raise ValueError(f"run {run_dir} has no complete checkpoint of step {step} ({root / checkpoint_dir_name(step)})"
                     f"{why}; complete checkpoints: {have}")


def _check_out_writable(final: Path, out: Path) -> None:
    """ValueError naming OUT when the folder it would be made in is a file or takes no new folder (read-only,
    no permission), instead of an OSError about a temporary path after the checkpoint was read."""
    import tempfile

    where = final.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        raise ValueError(f"OUT {out} cannot be made: {where} is a file, not a folder; choose another OUT")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rlrepro-export-probe-", dir=where))
    except OSError as e:
        raise ValueError(f"OUT {out} cannot be made: {where} takes no new folder ({e.strerror or e}); choose an "
                         "OUT in a folder you can write to") from None


def export_checkpoint(run_dir: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None,
                      base: str | os.PathLike | None = None) -> Path:
    """Write the policy of the run's checkpoint of ``step`` (default: the newest complete one) as an HF directory
    ``out``: from a full checkpoint through ``rlrepro.model.resolve_model_dir`` / ``load_resolved`` (weights in the
    checkpoint's dtype, sha256 checked), from a ``checkpoint.format=dist`` one through
    ``rlrepro.trainer.megatron.dist_to_hf``. Tokenizer and config.json come from the run's model directory (or
    ``base``). ``out`` must not exist or be empty, nor lie inside the run's ``checkpoints/``; it is complete or
    absent, and a failed export removes only what it made (an empty ``out`` that was there stays)."""
    from rlrepro.model import load_resolved, resolve_model_dir, save_pretrained
    from rlrepro.model.model_dirs import checkpoint_base
    from rlrepro.trainer.checkpoint import verify_checkpoint

    run_dir, out = Path(run_dir), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} already exists and is not an empty directory; choose another OUT or remove it")
    ckpts = (run_dir / "checkpoints").resolve()
    if out.resolve() == ckpts or ckpts in out.resolve().parents:
        raise ValueError(f"{out} is inside the run's checkpoints/ ({ckpts}): a checkpoint directory holds exactly "
                         "what its manifest lists, and a step_NNNNNN there is the run's to replace; choose an OUT "
                         "outside it")
    final = out.resolve()
    _check_out_writable(final, out)  # before the checkpoint's hashes are read (minutes for a large model)
    ckpt = checkpoint_of(run_dir, step)
    manifest = verify_checkpoint(ckpt, check_hashes=True)
    made = _missing_parents(final)  # what a failed export removes besides its own temporary directory
    tmp = new_export_tmp(final)
    empty = final.is_dir()  # the user's empty OUT: kept until the export is complete (finish_export)
    try:
        if manifest.get("layout") not in (None, "full"):
            from rlrepro.trainer.megatron import dist_to_hf

            tok = Path(base) if base is not None else checkpoint_base(ckpt, run_dir)
            dist_to_hf(ckpt, tmp, tokenizer_from=tok)
        else:
            resolved = resolve_model_dir(ckpt, base=base)
            tok = resolved.tokenizer_dir
            save_pretrained(load_resolved(resolved), tmp, tokenizer_from=tok)
        return finish_export(tmp, final, tok, replace_empty=empty)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in made:  # the folders the export made for OUT, deepest first, if nothing else went into them
            try:
                d.rmdir()
            except OSError:
                break
        raise


def _missing_parents(path: Path) -> list[Path]:
    """The ancestors of ``path`` that do not exist yet (which writing it creates), deepest first."""
    out = []
    for parent in path.parents:
        if parent.exists() or parent.is_symlink():
            break
        out.append(parent)
    return out


def main_export(argv: list[str]) -> int:
    """``rlrepro export RUN [--step K] [--base HF_DIR] OUT``: exit 0, or 2 with a message on a bad argument."""
    import argparse

    ap = argparse.ArgumentParser(prog="rlrepro export",
                                 description="write a run's checkpoint as an HF model directory (transformers, vLLM, "
                                             "SGLang load it), from full and dist checkpoints")
    ap.add_argument("run", help="the run directory")
    ap.add_argument("out", help="the HF directory to write (must not exist, or be empty)")
    ap.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest complete one)")
    ap.add_argument("--base", default=None, help="HF dir with the config.json and tokenizer (default: the run's)")
    ns = ap.parse_args(argv)
    try:
        path = export_checkpoint(ns.run, ns.out, step=ns.step, base=ns.base)
    except (ValueError, OSError) as e:
        print(f"rlrepro export: {e}", file=sys.stderr)
        return 2
    print(f"rlrepro export: wrote {path}", file=sys.stderr)
    return 0

"""Local sources: the data files of a directory and the split each belongs to, and sources that look like data
files but are not (a directory written by ``datasets``' ``save_to_disk``). Internal to ``rlrepro.data.loading``.

Split rule (closest to ``datasets``' own default patterns, which try split folder names before file-name prefixes):
a file's split is the folder on its relative path named after a split (``train/``, ``test/``, ``validation/``,
...) if there is one, else the split its file name starts with (``train.jsonl``, ``test-00000-of-00002.parquet``,
``dev_hard.jsonl``; the longest such name). So ``train/test_cases.jsonl`` is in ``train`` only, never in ``test``
too (before, it was in both: a train/test leak). A file under two split folders (``train/test/a.jsonl``) is
refused, naming the file and the fix. Split names: ``KNOWN_SPLITS`` and the one asked for.

``save_to_disk``: ``save_to_disk`` writes Arrow files (``data-00000-of-00001.arrow``) with JSON
metadata beside them (``state.json``, ``dataset_info.json``, and ``dataset_dict.json`` for a ``DatasetDict``).
``load_records`` reads ``.jsonl`` / ``.json`` / ``.parquet`` only, so it used to take that metadata for rows and
answer ``the prompt field 'prompt' is not in the data set; fields that exist: ['citation', 'description', ...].
Fix: set data.prompt_field=citation``: a wrong fix. Such a source is refused with the way to export it instead.

Run directories: what ``rlrepro train`` writes (``metrics.jsonl``, ``amendments.jsonl``, ``inputs.json``,
``checkpoints/``, ...) is a run's record, never data. A source that is a run directory (or lies in one's records) is
refused ("a run directory, not data"); in a directory that holds run directories (``data.source=runs``, or a project
folder with ``runs/`` in it) their records are left out, and when nothing else is left the source is refused too.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

__all__ = ["DATA_FILE_FORMATS", "KNOWN_SPLITS", "local_files", "split_of", "check_not_saved_dataset", "source_files"]

# file suffix -> datasets builder
DATA_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
KNOWN_SPLITS = ("train", "test", "validation", "valid", "val", "dev", "eval")
_METADATA = ("state.json", "dataset_info.json", "dataset_dict.json")
# what rlrepro writes in a run directory (rlrepro.repro.records, orchestration): a folder with config.yaml and one
# of RUN_RECORDS is a run directory; those files and the folders RUN_FOLDERS in it are its records, not data
RUN_RECORDS = ("metrics.jsonl", "fingerprints.jsonl", "amendments.jsonl", "inputs.json", "summary.json")
RUN_FOLDERS = ("checkpoints", "rollouts", "plots", "wandb")  # verify/from_K is a run directory itself
# the model directories a run writes (base_model/, its base_model.tmp-* left by a killed start, export/step_N/):
# records too (an HF directory's config.json is no data set); a run's data/synthetic_<task>.jsonl is data the run
# made for itself: read when data.source names it (or its data/ folder), left out of a folder that holds the run
RUN_MODELS = ("base_model", "export")

logger = logging.getLogger(__name__)


def is_run_dir(folder: Path) -> bool:
    """Whether ``folder`` is a run directory that ``rlrepro train`` wrote, or is writing: a run being started
    (its run.dir inside the data folder: ``data.source=.``) loads its data holding its ``.lock`` and
    ``base_model/`` before config.yaml or any record."""
    if not (folder / ".lock").is_file():
        return (folder / "config.yaml").is_file() and any((folder / n).is_file() for n in RUN_RECORDS)
    return (folder / "config.yaml").is_file() or (folder / "base_model" / "manifest.json").is_file()


def _is_record(rest: tuple[str, ...], scan: bool) -> bool:
    """Whether the path ``rest`` (parts, relative to a run directory) is one of the run's records; ``scan``: met in
    a folder that holds the run (then the run's synthetic data set is left out too)."""
    head = rest[0]
    if head in RUN_FOLDERS or (len(rest) == 1 and head in RUN_RECORDS) or head.split(".tmp", 1)[0] in RUN_MODELS:
        return True
    return scan and head == "data" and len(rest) == 2 and rest[1].startswith("synthetic_")


def _run_record_of(path: Path, root: Path, runs: dict[Path, bool], scan: bool = False) -> Path | None:
    """The run directory (``root`` or a folder under it) whose record ``path`` is or lies in, else None."""
    return next((folder for folder, rest in _runs_above(path, root, runs) if _is_record(rest, scan)), None)


def _runs_above(path: Path, root: Path, runs: dict[Path, bool]):
    """(run directory, the rest of ``path`` in it) for each run directory from ``root`` down to ``path``'s folder
    (``runs``: is_run_dir's answers so far, filled in)."""
    parts = path.relative_to(root).parts
    for i in range(len(parts)):
        folder = root.joinpath(*parts[:i])
        if folder not in runs:
            runs[folder] = is_run_dir(folder)
        if runs[folder]:
            yield folder, parts[i:]


def _refuse_run_dir(path: Path, what: str) -> ValueError:
    return ValueError(f"data.source={str(path)!r} {what}, not data. Fix: set data.source to your data set: a "
                      f".jsonl/.json/.parquet file with a prompt and an answer per row, or a directory of them.")


def _is_saved_dataset(folder: Path) -> bool:
    """``folder`` is what ``save_to_disk`` wrote: a ``DatasetDict`` (``dataset_dict.json``) or a ``Dataset``
    (``state.json`` beside ``.arrow`` files)."""
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and any(p.is_file() for p in folder.glob("*.arrow")))


def check_not_saved_dataset(path: Path, split: str = "train") -> None:
    """Raise ``ValueError`` when ``path`` (a local file or directory) is, or holds, a ``save_to_disk`` data set, whose
    ``.json`` files are metadata rather than rows. Hidden folders are not searched (the loader ignores them too)."""
    if path.is_file():
        found = path.parent if path.name in _METADATA and _is_saved_dataset(path.parent) else None
    else:
        root = path.resolve()
        marks = ("state.json", "dataset_dict.json")
        folders = [root] + sorted({p.parent for p in root.rglob("*.json") if p.name in marks
                                   and not any(part.startswith(".") for part in p.relative_to(root).parts)})
        found = next((f for f in folders if _is_saved_dataset(f)), None)
    if found is None:
        return
    top = found.parent if (found.parent / "dataset_dict.json").is_file() else found
    kind, pick = ("DatasetDict", f"[{split!r}]") if (top / "dataset_dict.json").is_file() else ("Dataset", "")
    raise ValueError(
        f"{path}: {found} is a data set written by datasets' save_to_disk (Arrow files with {', '.join(_METADATA)} "
        f"metadata), which data.source does not read: its .json files are metadata, not rows. Fix: export it once to "
        f"a file data.source reads, e.g. python -c \"import datasets; datasets.load_from_disk('{top}'){pick}"
        f".to_parquet('{split}.parquet')\" (a {kind}), then set data.source={split}.parquet.")


def local_files(path: Path, split: str) -> list[tuple[Path, str]]:
    """(file, source_name) pairs in load order: ``path`` itself, or the files of directory ``path`` in ``split``
    sorted by relative path (code-point order: the same on every filesystem and locale)."""
    if not isinstance(split, str) or not split or "/" in split:
        raise ValueError(f"data.split={split!r} is not a split name (such as train or test). "
                         f"Fix: set data.split=train (or the split to load).")
    check_not_saved_dataset(path, split)  # its .json files are metadata, not rows
    resolved, runs = path.resolve(), {}
    above = resolved.parents[min(7, len(resolved.parents) - 1)] if resolved.parents else resolved
    run = _run_record_of(resolved, above, runs)
    if run is not None:  # metrics.jsonl of a run, its checkpoints/ or rollouts/: a record, never data
        raise _refuse_run_dir(path, f"is {'a file' if path.is_file() else 'a folder'} of the records of the "
                              f"rlrepro run directory {run}")
    if path.is_dir() and is_run_dir(resolved):
        raise _refuse_run_dir(path, "is a run directory that rlrepro train wrote (config.yaml, metrics.jsonl, "
                              "checkpoints/, ...): its files are the run's records")
    if path.is_file():
        if path.suffix.lower() not in DATA_FILE_FORMATS:
            raise ValueError(f"{path}: unsupported file type {path.suffix!r}; supported: {sorted(DATA_FILE_FORMATS)}. "
                             f"Fix: convert it, or set data.source to a file or directory of those types.")
        return [(path, path.name)]
    root = path.resolve()
    files = sorted(
        (p for p in root.rglob("*")
         if p.is_file() and p.suffix.lower() in DATA_FILE_FORMATS
         and not any(part.startswith(".") for part in p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    of_run = {f: _run_record_of(f, root, runs, scan=True) for f in files}
    if any(of_run.values()):
        names = sorted({(path / r.relative_to(root)).as_posix() for r in of_run.values() if r is not None})
        shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
        files = [f for f in files if of_run[f] is None]
        if not files:
            raise _refuse_run_dir(path, f"is a folder of rlrepro run directories ({shown}) and holds no data "
                                  f"files: their .jsonl/.json files are the runs' records")
        logger.warning("data.source=%s: left out the records of %d run director%s in it (%s): they are not data",
                       path, len(names), "ies" if len(names) > 1 else "y", shown)
    if not files:
        raise ValueError(f"{path}: no data files in this directory (looked for {sorted(DATA_FILE_FORMATS)}, "
                         f"recursively). Fix: set data.source to a directory that holds them, or to one file.")
    rels = [f.relative_to(root).as_posix() for f in files]
    splits = [split_of(rel, split, path) for rel in rels]
    chosen = [f for f, s in zip(files, splits) if s == split]
    if not chosen:
        found = sorted({s for s in splits if s is not None})
        if not found and split == "train":
            chosen = files  # a directory without split names is one train split
        else:
            raise ValueError(
                f"{path}: no files for split {split!r}; splits found: {found or ['train (no split names)']}; "
                f"files: {rels[:10]}{' ...' if len(rels) > 10 else ''}. Fix: set data.split=<one of the splits "
                f"found>."
            )
    return [(f, f"{root.name}/{f.relative_to(root).as_posix()}") for f in chosen]


def source_files(path: Path) -> list[Path]:
    """The files of a local data source that a run's inputs.json digests (``data.files``): ``path`` itself, or every
    file under the folder (any type: a changed file beside the data is a changed input) except hidden ones (a run's
    ``.lock``) and the files of run directories inside it (config.yaml, checkpoints, rollouts, base_model/, ...),
    which a run writes while it runs: a resume would see them as changed data, and a start would hash its
    checkpoints."""
    path = Path(path)
    if not path.is_dir():
        return [path] if path.is_file() else []
    root, runs = path.resolve(), {}
    files = sorted(p for p in root.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))
    return [path / f.relative_to(root) for f in files if next(_runs_above(f, root, runs), None) is None]


def split_of(rel: str, split: str, root: Path | str = ".") -> str | None:
    """The split of the file at relative path ``rel`` (``/``-separated) under the rule of the module docstring,
    among ``KNOWN_SPLITS`` and ``split``; None when neither a folder nor the file name names one."""
    names = {*KNOWN_SPLITS, split}
    parts = rel.split("/")
    folders = sorted({p for p in parts[:-1] if p in names})
    if len(folders) > 1:
        raise ValueError(
            f"{root}: the file {rel!r} lies under the split folders {folders}, so its split is ambiguous (it would "
            f"be read into more than one split: a train/test leak). Fix: move it so that one folder on its path "
            f"names its split (e.g. {folders[0]}/{parts[-1]}), or rename the other folders.")
    if folders:
        return folders[0]
    prefixes = sorted(n for n in names if re.match(rf"{re.escape(n)}([-_.]|$)", parts[-1]))
    return max(prefixes, key=len) if prefixes else None

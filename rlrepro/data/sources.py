"""Local sources that look like data files but are not: a directory written by ``datasets``' ``save_to_disk``.

Internal to ``rlrepro.data.loading``. ``save_to_disk`` writes Arrow files (``data-00000-of-00001.arrow``) with JSON
metadata beside them (``state.json``, ``dataset_info.json``, and ``dataset_dict.json`` for a ``DatasetDict``).
``load_records`` reads ``.jsonl`` / ``.json`` / ``.parquet`` only, so it used to take that metadata for rows and
answer ``the prompt field 'prompt' is not in the data set; fields that exist: ['citation', 'description', ...].
Fix: set data.prompt_field=citation``: a wrong fix. Such a source is refused with the way to export it instead.
"""
from __future__ import annotations

from pathlib import Path

_METADATA = ("state.json", "dataset_info.json", "dataset_dict.json")


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

"""Where Ray's worker processes import from: never the driver's working directory first.

When a driver connects, Ray (2.60, ``ray._private.worker.connect``) adds the driver's working directory, and its
script's directory when that is on the driver's ``sys.path``, to ``JobConfig._py_driver_sys_path``; every worker
of the job then puts them at the front of its ``sys.path`` before it imports the actor classes. A ``statistics.py``
or ``difflib.py`` in the directory ``rlrepro train`` was started from then replaced the standard library's in
every rollout worker and trainer (found by planting one file per standard-library module there: 16 of them ran in
the actors). rlrepro is an installed package, and the actors import nothing from the user's directory unasked, so
its jobs are started with a JobConfig whose list of driver paths stays empty:
``ray.init(..., job_config=job_config_without_driver_paths())``.

Multi-turn runs (``env.*``) score and step environments in the rollout workers, which import ``reward.fn`` and
``env.fn``. :func:`module_dirs` names the directory each of those modules was found in by the driver; a worker
*appends* them to its ``sys.path`` (:func:`append_to_path`), so the user's module imports there too while the
installed packages and the standard library still come first.
"""
from __future__ import annotations

__all__ = ["job_config_without_driver_paths", "module_dirs", "append_to_path"]


class _NoDriverPaths(list):
    """A list that ignores ``extend``: what ``connect`` appends the driver's directories with."""

    def extend(self, paths) -> None:  # noqa: D401 - list API
        return None


def job_config_without_driver_paths(**kwargs):
    """A ``ray.job_config.JobConfig(**kwargs)`` under which Ray puts none of the driver's directories on the
    workers' ``sys.path`` (they keep the installed packages and Ray's own paths)."""
    from ray.job_config import JobConfig

    job_config = JobConfig(**kwargs)
    job_config._py_driver_sys_path = _NoDriverPaths(getattr(job_config, "_py_driver_sys_path", []))
    return job_config


def module_dirs(specs) -> list[str]:
    """The directories the driver imports the modules of ``specs`` from (``pkg.module:attr`` or
    ``pkg.module.attr``, split as the loaders split them, by ``rlrepro.data.specs.split_spec``; built-in names,
    without a dot or colon, and None are skipped): for each, the directory holding its top-level package or
    module. In the order given, without repeats."""
    import importlib.util
    from pathlib import Path

    from rlrepro.data.specs import SpecError, split_spec

    out: list[str] = []
    for spec in specs:
        if not spec:
            continue
        try:
            module = split_spec(spec)[0]
        except SpecError:  # a built-in name
            continue
        try:
            found = importlib.util.find_spec(module.split(".")[0])
        except (ImportError, ValueError):
            continue
        if found is None or not found.origin or found.origin in ("built-in", "frozen"):
            continue
        origin = Path(found.origin)
        root = origin.parent.parent if origin.name == "__init__.py" else origin.parent
        if str(root) not in out:
            out.append(str(root))
    return out


def append_to_path(dirs) -> None:
    """Append each of ``dirs`` to ``sys.path`` unless it is there already (after everything else)."""
    import sys

    for d in dirs or ():
        if d not in sys.path:
            sys.path.append(d)

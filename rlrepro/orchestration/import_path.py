"""Where Ray's worker processes import from: never the driver's working directory first.

When a driver connects, Ray (2.60, ``ray._private.worker.connect``) adds the driver's working directory, and its
script's directory when that is on the driver's ``sys.path``, to ``JobConfig._py_driver_sys_path``; every worker
of the job then puts them at the front of its ``sys.path`` before it imports the actor classes. A ``statistics.py``
or ``difflib.py`` in the directory ``rlrepro train`` was started from then replaced the standard library's in
every rollout worker and trainer (found by planting one file per standard-library module there: 16 of them ran in
the actors). rlrepro is an installed package, and the actors import nothing from the user's directory (rewards are
scored in the driver), so its jobs are started with a JobConfig whose list of driver paths stays empty:
``ray.init(..., job_config=job_config_without_driver_paths())``.
"""
from __future__ import annotations

__all__ = ["job_config_without_driver_paths"]


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

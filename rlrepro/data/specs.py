"""User code named in the config: a spec ``pkg.module:attr`` (or ``pkg.module.attr``; ``pkg.module:Class.attr``
too), as ``reward.fn`` and ``env.fn`` take them.

One rule splits a spec and imports what it names, so the reward loader (``rlrepro.data.rewards``), the
environment loader (``rlrepro.envs.registry``) and the driver, which tells its workers where the modules are
(``rlrepro.orchestration.import_path``), agree on it. The rule: a ``:`` separates the module from the attribute
path (the first ``:``), else the last ``.`` does. Each loader words its own errors from the :class:`SpecError`
raised here, naming its own config key.

Importing the module runs its top-level code: use only code you trust.
"""
from __future__ import annotations

import importlib
from typing import Any, Literal

__all__ = ["SpecError", "SpecProblem", "split_spec", "import_spec", "spec_shape_problem"]

SpecProblem = Literal["no_path", "malformed", "import", "attribute"]


class SpecError(ValueError):
    """Why ``spec`` does not name an object. ``problem``:

    - ``"no_path"``: neither ``:`` nor ``.`` in it (a plain name, such as a misspelt built-in);
    - ``"malformed"``: the module or the attribute path is empty (``":fn"``, ``"pkg.mod:"``);
    - ``"import"``: the module ``module_name`` does not import (the exception it raised is ``__cause__``);
    - ``"attribute"``: ``owner`` (the module, or an object on the way) has no attribute ``attr``.
    """

    def __init__(self, problem: SpecProblem, spec: str, *, module_name: str = "", attr: str = "",
                 owner: Any = None) -> None:
        self.problem, self.spec, self.module_name, self.attr, self.owner = problem, spec, module_name, attr, owner
        super().__init__(f"{spec!r}: {problem}" + (f" ({module_name!r}, {attr!r})" if module_name or attr else ""))

    @property
    def owner_name(self) -> str:
        """The name of ``owner`` (its ``__name__``), else the module's name."""
        return getattr(self.owner, "__name__", self.module_name)


def split_spec(spec: str) -> tuple[str, str]:
    """``(module name, attribute path)`` of ``spec``: split at the first ``:``, else at the last ``.``; raises
    :class:`SpecError` ``"no_path"`` when it has neither. Either part may come back empty (:func:`import_spec`
    refuses that)."""
    if ":" in spec:
        module_name, _, attr_path = spec.partition(":")
    elif "." in spec:
        module_name, _, attr_path = spec.rpartition(".")
    else:
        raise SpecError("no_path", spec)
    return module_name, attr_path


def import_spec(spec: str) -> Any:
    """The object ``spec`` names: its module imported (from ``sys.path``: the working directory or the installed
    packages), then each name of the attribute path looked up in turn. Raises :class:`SpecError` when it does
    not resolve; checks nothing about the object itself."""
    module_name, attr_path = split_spec(spec)
    if not module_name or not attr_path:
        raise SpecError("malformed", spec, module_name=module_name, attr=attr_path)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise SpecError("import", spec, module_name=module_name) from e
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise SpecError("attribute", spec, module_name=module_name, attr=part, owner=obj)
        obj = getattr(obj, part)
    return obj


def spec_shape_problem(key: str, spec: str, e: SpecError, what: str) -> str | None:
    """The message for a ``key=spec`` (``reward.fn``, ``env.fn``) whose shape is the mistake, or None: a space where
    the ':' goes (``my_reward reward``), or a file path for the module (``my_reward.py:reward``, ``mods/x.py:f``).
    ``what``: what follows the ':' (function, factory)."""
    if e.problem == "no_path" and " " in spec.strip():
        return f"{key}={spec!r} must look like {key}=pkg.module:{what} (a ':' between the module and the {what})"
    module = e.module_name or ""
    if e.problem == "import" and (".py" in module or "/" in module):
        stem = module.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".py")
        attr = spec.rsplit(":", 1)[1] if ":" in spec else what
        return (f"{key}={spec!r} names a file; give the module's name instead ({key}={stem}:{attr}), with its "
                "folder on PYTHONPATH (or the folder you run from)")
    return None

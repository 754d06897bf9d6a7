"""``ConfigError`` and the value checks that every component's config dataclass runs in ``__post_init__``.

Each component owns its config (``rollout.EngineConfig``, ``rollout.SamplingConfig``, ``trainer.TrainConfig``,
``data.config.DataConfig``, ...); the run schema (:mod:`rlrepro.orchestration.config`) is the tree of them.
A config class names its place in that tree with ``SECTION`` so that its messages name the key a command-line
user types (``train.lr``, ``rollout.max_num_seqs``). Plain Python, nothing else of rlrepro.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["ConfigError", "Checker", "plain_number", "finite_number"]


class ConfigError(ValueError):
    """A configuration problem found before any work starts; the message names the key, the value and the fix."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def plain_number(value: Any) -> Any:
    """A numpy scalar (``np.int64(64)``, ``np.float32(0.7)``: a config built in code) as the Python int or float
    it holds, as :class:`rlrepro.rollout.SamplingParams` takes them, so that the checks, ``config.yaml`` (OmegaConf
    takes no numpy) and the records see one type; anything else (numpy bools too) unchanged."""
    if type(value) in (bool, int, float) or not hasattr(value, "item"):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def finite_number(value: Any) -> bool:
    """An int or float (not a bool) that is finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Checker:
    """The checks of one config object: ``Checker(self).positive_int("max_num_seqs")`` raises ConfigError
    naming ``<SECTION>.max_num_seqs`` and the value."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.section = getattr(obj, "SECTION", "")
        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name, None)
                plain = plain_number(value)
                if plain is not value:
                    object.__setattr__(obj, f.name, plain)

    def key(self, name: str) -> str:
        return f"{self.section}.{name}" if self.section else name

    def _value(self, name: str) -> Any:
        return getattr(self.obj, name)

    def fail(self, name: str, message: str) -> None:
        raise ConfigError(f"{self.key(name)}={self._value(name)!r} {message}")

    def positive_int(self, *names: str, optional: bool = False) -> None:
        for name in names:
            v = self._value(name)
            if optional and v is None:
                continue
            if not _is_int(v) or v < 1:
                self.fail(name, "must be a positive integer" + (" or null (unset)" if optional else ""))

    def int_at_least(self, name: str, low: int) -> None:
        v = self._value(name)
        if not _is_int(v) or v < low:
            self.fail(name, f"must be an integer >= {low}")

    def integer(self, *names: str) -> None:
        for name in names:
            if not _is_int(self._value(name)):
                self.fail(name, "must be an integer")

    def non_negative(self, *names: str) -> None:
        for name in names:
            v = self._value(name)
            if not finite_number(v) or v < 0:
                self.fail(name, "must be a finite number >= 0")

    def in_range(self, name: str, low: float, high: float, *, low_inclusive: bool = True,
                 high_inclusive: bool = True) -> None:
        v = self._value(name)
        ok = (finite_number(v) and (low <= v if low_inclusive else low < v)
              and (v <= high if high_inclusive else v < high))
        if not ok:
            self.fail(name, f"must lie in {'[' if low_inclusive else '('}{low}, {high}{']' if high_inclusive else ')'}")

    def choice(self, name: str, choices: Iterable[Any], elsewhere: Mapping[str, str] | None = None) -> None:
        """``name`` must be one of ``choices``; ``elsewhere``: another framework's spelling -> ours (named in the
        error: verl's ``low_var_kl`` is ``k3`` here)."""
        choices = list(choices)
        v = self._value(name)
        if v not in choices:
            ours = (elsewhere or {}).get(v) if isinstance(v, str) else None
            hint = f": it is verl's name for {ours}; set {self.key(name)}={ours}" if ours else ""
            self.fail(name, f"is not allowed; choose one of {choices}{hint}")

    def boolean(self, *names: str) -> None:
        for name in names:
            if not isinstance(self._value(name), bool):
                self.fail(name, "must be true or false")

    def require(self, ok: bool, name: str, message: str) -> None:
        if not ok:
            self.fail(name, message)

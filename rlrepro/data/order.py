"""Seeded epoch order: which data items each step takes, as a pure function of (seed, epoch, cursor).

The order of epoch ``e`` is ``Generator(PCG64(SeedSequence([seed, e]))).permutation(num_items)``, so it does
not depend on how many batches came before, on their sizes, or on a global RNG. The only state is the
position (epoch, cursor); it goes into every checkpoint, and a resumed run takes the same items as an
uninterrupted one. NumPy's Generator streams may change between NumPy versions, which the reproducibility
promise already excludes (same software versions); ``tests/test_data_order.py`` pins the values.
"""
from __future__ import annotations

import numbers
from typing import Any

import numpy as np

__all__ = ["EpochOrder"]

_STATE_VERSION = 1


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class EpochOrder:
    """Endless sequence of item indices in ``range(num_items)``, epoch after epoch."""

    def __init__(self, num_items: int, seed: int, shuffle: bool = True) -> None:
        if isinstance(num_items, numbers.Integral) and not isinstance(num_items, bool) and num_items == 0:
            raise ValueError("num_items is 0: the data set is empty, there is nothing to order. "
                             "Fix: check that the data set (data.source) loaded records.")
        self.num_items = _check_int("num_items", num_items, 1)
        self.seed = _check_int("run.seed", seed, 0)
        if not isinstance(shuffle, bool):
            raise ValueError(f"data.shuffle={shuffle!r} is not a bool. Fix: set data.shuffle=true or "
                             f"data.shuffle=false.")
        self.shuffle = shuffle
        self.epoch = 0    # epoch of the next item
        self.cursor = 0   # position of the next item within that epoch's order, always < num_items
        self._cached: tuple[int, np.ndarray] | None = None

    def permutation(self, epoch: int) -> list[int]:
        """The order of the items in ``epoch`` (identity when shuffle is off)."""
        return self._order(_check_int("epoch", epoch, 0)).tolist()

    def _order(self, epoch: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != epoch:
            if self.shuffle:
                rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
                order = rng.permutation(self.num_items)
            else:
                order = np.arange(self.num_items)
            self._cached = (epoch, order)
        return self._cached[1]

    def next_batch(self, n: int) -> list[int]:
        """The next ``n`` item indices; an epoch boundary inside the batch continues with the next epoch's order."""
        n = _check_int("n", n, 1)
        out: list[int] = []
        while len(out) < n:
            order = self._order(self.epoch)
            take = min(n - len(out), self.num_items - self.cursor)
            out.extend(order[self.cursor:self.cursor + take].tolist())
            self.cursor += take
            if self.cursor == self.num_items:
                self.epoch, self.cursor = self.epoch + 1, 0
        return out

    @property
    def position(self) -> int:
        """Items handed out so far."""
        return self.epoch * self.num_items + self.cursor

    def state_dict(self) -> dict[str, Any]:
        """The data cursor for a checkpoint: plain ints and bools, JSON-serialisable."""
        return {"version": _STATE_VERSION, "epoch": self.epoch, "cursor": self.cursor,
                "num_items": self.num_items, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position. The state must come from an order over the same data size, seed and shuffle:
        resuming with another data set or seed would silently take different items, so it raises instead."""
        missing = sorted({"epoch", "cursor", "num_items", "seed", "shuffle"} - set(state))
        if missing:
            raise ValueError(f"EpochOrder state lacks {missing}; got keys {sorted(state)}")
        if state.get("version", _STATE_VERSION) != _STATE_VERSION:
            raise ValueError(f"EpochOrder state version {state['version']!r} is not {_STATE_VERSION}")
        for key in ("num_items", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"EpochOrder state has {key}={state[key]!r} but this order has {key}={getattr(self, key)!r}. "
                    f"Fix: resume with the data set (data.source, data.limit), run.seed and data.shuffle of the "
                    f"checkpoint.")
        epoch = _check_int("epoch", state["epoch"], 0)
        cursor = _check_int("cursor", state["cursor"], 0)
        if cursor >= self.num_items:
            raise ValueError(f"EpochOrder state cursor {cursor} is out of range for {self.num_items} items")
        self.epoch, self.cursor = epoch, cursor

    def __repr__(self) -> str:
        return (f"EpochOrder(num_items={self.num_items}, seed={self.seed}, shuffle={self.shuffle}, "
                f"epoch={self.epoch}, cursor={self.cursor})")

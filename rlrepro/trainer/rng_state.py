"""The RNG states a resumed run must continue from (what ``rng.pt`` of a checkpoint holds): Python ``random``,
numpy's global state, torch CPU, every CUDA device, and the caller's named generators (``torch.Generator``,
``numpy.random.Generator``, ``random.Random``). :func:`check_rng_state` raises what :func:`restore_rng_state` would
without changing any RNG, so :func:`rlrepro.trainer.checkpoint.load_checkpoint` refuses before it loads anything."""
from __future__ import annotations

import random
from collections.abc import Mapping

import numpy as np
import torch

__all__ = ["capture_rng_state", "check_rng_state", "restore_rng_state"]


def _np_to_plain(obj):
    """numpy state -> torch-loadable plain objects (ndarrays become tagged int64 tensors)."""
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": torch.from_numpy(obj.astype(np.int64)), "dtype": str(obj.dtype)}
    if isinstance(obj, dict):
        return {k: _np_to_plain(v) for k, v in obj.items()}
    if isinstance(obj, tuple | list):
        return type(obj)(_np_to_plain(v) for v in obj)
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _plain_to_np(obj):
    if isinstance(obj, dict) and "__ndarray__" in obj:
        return obj["__ndarray__"].numpy().astype(obj["dtype"])
    if isinstance(obj, dict):
        return {k: _plain_to_np(v) for k, v in obj.items()}
    if isinstance(obj, tuple | list):
        return type(obj)(_plain_to_np(v) for v in obj)
    return obj


def _generator_state(gen):
    if isinstance(gen, torch.Generator):
        return {"kind": "torch", "state": gen.get_state()}
    if isinstance(gen, np.random.Generator):
        return {"kind": "numpy", "state": _np_to_plain(gen.bit_generator.state)}
    if isinstance(gen, random.Random):
        return {"kind": "python", "state": gen.getstate()}
    raise TypeError(f"cannot capture the state of {type(gen).__name__}; register a torch.Generator, "
                    "numpy.random.Generator or random.Random")


def capture_rng_state(generators: Mapping[str, object] | None = None) -> dict:
    """Every RNG a resumed run must continue from: Python ``random``, numpy's global state, torch CPU, every CUDA
    device (when CUDA is available), and the caller's named generators (torch, numpy or ``random.Random``)."""
    state = {
        "python": random.getstate(),
        "numpy": _np_to_plain(np.random.get_state()),
        "torch_cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "generators": {name: _generator_state(g) for name, g in (generators or {}).items()},
    }
    return state


_GEN_KINDS = {"torch": torch.Generator, "numpy": np.random.Generator, "python": random.Random}


def _trial(what: str, restore) -> None:
    """``restore()`` (a restore into a scratch generator); what it raises becomes a ValueError naming ``what``."""
    try:
        restore()
    except (TypeError, ValueError, RuntimeError, KeyError, IndexError, AttributeError) as e:
        raise ValueError(f"the checkpoint's {what} RNG state cannot be restored ({type(e).__name__}: {e}); rng.pt is "
                         "damaged or not rlrepro's: resume from an earlier checkpoint") from None


def _scratch(kind: str, gen, value) -> None:
    if kind == "torch":
        torch.Generator(device=gen.device).set_state(value)
    elif kind == "numpy":
        type(gen.bit_generator)().state = _plain_to_np(value)
    else:
        random.Random().setstate(value)


def check_rng_state(state: Mapping, generators: Mapping[str, object] | None = None) -> None:
    """Raise what :func:`restore_rng_state` would (CUDA device count, generator names and kinds, a state a setter
    refuses: each is tried on a scratch generator) without changing any RNG: :func:`load_checkpoint` runs it before
    it loads anything, so a refused load leaves everything as it was and the restore it ends with cannot fail."""
    cuda = list(state["cuda"])
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda and have != len(cuda):
        raise ValueError(f"the checkpoint holds RNG states for {len(cuda)} CUDA devices but {have} are visible; "
                         "resume with the same CUDA_VISIBLE_DEVICES as the saving run")
    saved, given = state.get("generators", {}), dict(generators or {})
    if set(saved) != set(given):
        raise ValueError(f"the checkpoint holds generators {sorted(saved)} but {sorted(given)} were passed; "
                         "pass the same named generators to restore_rng_state/load_checkpoint as to capture")
    _trial("Python random", lambda: random.Random().setstate(state["python"]))
    _trial("numpy", lambda: np.random.RandomState().set_state(_plain_to_np(state["numpy"])))
    _trial("torch CPU", lambda: torch.Generator().set_state(state["torch_cpu"]))
    for i, one in enumerate(cuda):
        _trial(f"CUDA device {i}", lambda i=i, one=one: torch.Generator(device=f"cuda:{i}").set_state(one))
    for name, gen in given.items():
        if not isinstance(saved[name], Mapping) or "state" not in saved[name]:
            raise ValueError(f"the checkpoint's generator {name!r} has no saved state; rng.pt is damaged or not "
                             "rlrepro's: resume from an earlier checkpoint")
        if not isinstance(gen, _GEN_KINDS.get(saved[name].get("kind"), ())):
            raise TypeError(f"generator {name!r} was saved as a {saved[name].get('kind')} generator, "
                            f"got a {type(gen).__name__}")
        _trial(f"generator {name!r}", lambda g=gen, e=saved[name]: _scratch(e["kind"], g, e["state"]))


def restore_rng_state(state: Mapping, generators: Mapping[str, object] | None = None) -> None:
    """Put back what :func:`capture_rng_state` took; ``generators`` must name the same generators (checked first:
    a refused restore changes no RNG)."""
    check_rng_state(state, generators)
    random.setstate(state["python"])
    np.random.set_state(_plain_to_np(state["numpy"]))
    torch.set_rng_state(state["torch_cpu"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(list(state["cuda"]))
    saved = state.get("generators", {})
    for name, gen in dict(generators or {}).items():
        kind, value = saved[name]["kind"], saved[name]["state"]
        if kind == "torch":
            gen.set_state(value)
        elif kind == "numpy":
            gen.bit_generator.state = _plain_to_np(value)
        else:
            gen.setstate(value)

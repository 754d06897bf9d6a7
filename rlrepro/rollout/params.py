"""Per-request sampling parameters and the engine's output record (plain Python, no torch)."""
from __future__ import annotations

import functools
import inspect
import math
import numbers
import operator
from dataclasses import dataclass, field, fields

from rlrepro.checks import plain_number

MAX_SEED = 2**63  # request seeds are 63-bit non-negative integers
MIN_TEMPERATURE = 1e-5  # below this logits / T may overflow float32; use 0 for greedy decoding


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_int(value: object) -> int | None:
    """A token id as a Python int: ints, numpy integer scalars (``numbers.Integral``) and 0-d integer tensors or
    arrays, as prompts take them; None for anything else (bools and bool tensors, floats, 1-D tensors)."""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if getattr(value, "ndim", None) == 0:  # torch.tensor(5), np.array(5): no torch import here (duck-typed)
        try:
            return operator.index(value)
        except TypeError:  # a float tensor
            return None
    return None


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples.

    ``temperature=0`` is greedy decoding (the first maximal logit; top-k/top-p are then irrelevant); ``0 < T <
    1e-5`` is refused (vLLM silently makes it greedy). ``top_k=-1`` (or any ``k >= vocab``) and ``top_p=1.0`` are
    off; ``top_k=0`` is refused (vLLM reads it as off). top-k keeps exactly ``k`` tokens (ties toward the lower
    id), then top-p the smallest prefix of the survivors whose mass reaches ``top_p``. The reported logprob is that
    of ``log_softmax(logits / T)`` before top-k/top-p (``T = 1`` when greedy): what the trainer recomputes.
    ``seed=None`` lets the engine derive one from its own seed and the request's submission index
    (see :func:`rlrepro.rollout.seeds.derive_seed`). ``stop_token_ids`` end a request with ``finish_reason
    "stop"`` and are kept in the output, as are EOS tokens (unless ``ignore_eos``); None is no stop ids, as ``()``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 128
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # numpy scalars (a seed from ``rng.integers``, a length from array arithmetic) are the numbers they hold,
        # as for token ids: stored as Python ints and floats (the same request, record and hash either way)
        for name in ("temperature", "top_p", "top_k", "max_tokens", "seed"):
            object.__setattr__(self, name, plain_number(getattr(self, name)))
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {t!r}; "
                             "use 0 for greedy decoding")
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"SamplingParams.temperature={t!r} is too small (logits / T overflows); "
                             f"use 0 for greedy decoding or a value >= {MIN_TEMPERATURE}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):
            raise ValueError(f"SamplingParams.top_p must lie in (0, 1], got {p!r}; use 1.0 to disable top-p")
        k = self.top_k
        if not _is_int(k) or (k < 1 and k != -1):
            raise ValueError(f"SamplingParams.top_k must be -1 (disabled) or an integer >= 1, got {k!r}")
        m = self.max_tokens
        if not _is_int(m) or m < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an integer >= 1, got {m!r}")
        s = self.seed
        if s is not None and (not _is_int(s) or not 0 <= s < MAX_SEED):
            raise ValueError(f"SamplingParams.seed must be None or an integer in [0, 2**63), got {s!r}; "
                             "rlrepro.rollout.request_seed(...) derives valid seeds")
        stops = self.stop_token_ids
        if stops is None:  # vLLM's and SGLang's default for "no stop ids": the same request as ()
            stops = ()
        if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__") or getattr(stops, "ndim", None) == 0:
            one = f"; wrap one id as stop_token_ids=({_token_int(stops)!r},)" if _token_int(stops) is not None else ""
            raise ValueError(f"SamplingParams.stop_token_ids must be a sequence of token ids, got {stops!r}{one}")
        stops = tuple(stops)
        ids = tuple(_token_int(x) for x in stops)  # numpy integers become ints: the same request, record and hash
        bad = [x for x, i in zip(stops, ids) if i is None or i < 0]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids must hold non-negative integer token ids; "
                             f"bad entries {bad!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be True or False, got {self.ignore_eos!r}")
        # + 0.0 turns -0.0 (accepted: it is not < 0) into 0.0: the same greedy request gets one record and repr
        object.__setattr__(self, "temperature", float(t) + 0.0)
        object.__setattr__(self, "top_p", float(p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_SEEDS_FIX = ("submit the prompt n times, each with its own seed (SamplingParams(seed=request_seed(run_seed, step, "
              "uid, j)) for j in range(n)); the prefix cache shares the prompt's K/V")
_PENALTY_FIX = ("rlrepro samples from the model's own distribution (what the trainer recomputes), so penalties are "
                "not offered; drop the argument")
# vLLM's and SGLang's sampling arguments that rlrepro does not take, each with what to do instead (docs/ENGINE.md)
NOT_OFFERED = {
    "n": _SEEDS_FIX, "best_of": _SEEDS_FIX,
    "max_new_tokens": "the argument is called max_tokens here (SGLang's max_new_tokens)",
    "stop": ("stop strings are not offered: pass token ids with stop_token_ids, or cut the decoded text after "
             "generation (a stop text may span tokens)"),
    "min_p": "min-p filtering is not offered; use top_k or top_p",
    "repetition_penalty": _PENALTY_FIX, "presence_penalty": _PENALTY_FIX, "frequency_penalty": _PENALTY_FIX,
    "logprobs": ("the chosen token's logprob always comes back in RequestOutput.logprobs; top-n logprobs are not "
                 "offered, drop the argument"),
    "min_tokens": "min_tokens is not offered; drop the argument (or ignore_eos=True to generate max_tokens tokens)",
    "logit_bias": "logit bias is not offered; drop the argument",
}


def _refuse_unknown_keywords(init):
    """``SamplingParams.__init__`` that names, for a vLLM/SGLang argument it does not take (``n``, ``stop``,
    ``min_p``, ``max_new_tokens``, penalties), what to do instead; other unknown keywords are refused the same
    way, with the arguments it takes."""
    known = {f.name for f in fields(SamplingParams)}

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            k = unknown[0]
            fix = NOT_OFFERED.get(k, f"the arguments are {sorted(known)}")
            raise TypeError(f"SamplingParams got the unknown argument {k}={kwargs[k]!r}: {fix}")
        init(self, *args, **kwargs)
    __init__.__signature__ = inspect.signature(init)  # type: ignore[attr-defined]
    return __init__


SamplingParams.__init__ = _refuse_unknown_keywords(SamplingParams.__init__)  # type: ignore[method-assign]


@dataclass
class RequestOutput:
    """One finished request. ``logprobs[i]`` is the float32 log-probability of ``token_ids[i]`` (see ENGINE.md)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS or a stop token) | "length" (max_tokens or max_model_len) | "abort" (abort())
    seed: int  # the sampling seed actually used (given or derived)
    weight_version: int  # engine.weight_version when the request ran
    request_id: int = -1  # the engine's index of the request (what add_request returned; generate's in order)
    # prompt tokens found in the prefix cache at the request's last admission: a statistic of scheduling (it
    # depends on what else ran), never a result, so not compared
    num_cached_tokens: int = field(default=0, compare=False)

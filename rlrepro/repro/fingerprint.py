"""Exact digests of tensors and values, and the per-step fingerprint record.

``tensor_digest`` (scheme ``v1``, specified in docs/RUN_DIRECTORY.md):

* the tensor's bytes in row-major order (little-endian), zero-padded to a multiple of 4, read as signed 32-bit
  words ``w[i]``, each sign-extended to 64 bits: ``v[i]``;
* words are grouped in blocks of ``BLOCK = 2**20``; for word ``i`` let ``j = i % BLOCK`` and ``r = i // BLOCK``;
* per block, in wrapping 64-bit arithmetic::

      S1[r] = sum_j v[i] * A1[j]
      S2[r] = sum_j (v[i] ^ A2[j])**2

* then ``H1 = sum_r S1[r] * K1[r]`` and ``H2 = sum_r splitmix64(S2[r] + K2[r])`` (mod 2**64), and the digest is
  ``sha256(header || H1 || H2)`` where the header names the scheme, dtype, shape and byte count.

``A1[j] = splitmix64(SEED_A1 + j) | 1``, ``A2[j] = splitmix64(SEED_A2 + j)``, ``K1[r] = splitmix64(SEED_K1 + r) | 1``,
``K2[r] = splitmix64(SEED_K2 + r)``. So ``H1 = sum_i v[i] * m(i)`` with the odd position-dependent multiplier
``m(i) = A1[j] * K1[r]``: flipping any single bit changes ``v[i]`` by ``±2**b`` (b < 32), hence ``H1`` by
``±2**b * m(i) != 0 (mod 2**64)`` — every single-bit change is detected, with certainty. ``H2`` is a second,
independent, non-linear mix against structured multi-bit changes.

Integer sums mod 2**64 do not depend on the order of additions, so the result is the same on every device, for any
reduction order and any chunking: ``tensor_digest(t.cpu()) == tensor_digest(t.cuda())``. On an accelerator only the
per-block sums (16 bytes per 4 MiB of tensor) travel to the host.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from rlrepro.samples import Sample

from .records import (  # noqa: F401  (re-exported: writers live with the digests in the public API)
    EVAL_FINGERPRINT_KEY,
    FingerprintWriter,
    JsonlStepWriter,
    MetricsWriter,
    ReproError,
    RolloutWriter,
    read_rollouts,
)
from .turns import turn_spans

__all__ = [
    "SCHEME", "FORMAT", "FIELDS", "SAMPLE_FIELDS", "TURN_FIELDS", "TURN_SAMPLE_FIELDS", "SAMPLE_DIGEST_HEX",
    "tensor_digest", "tensor_digests", "digest_values", "weights_digest", "optimizer_state_digest", "STATE_FIELDS",
    "StepFingerprint", "fingerprint_step", "fingerprint_from_samples", "eval_fingerprint", "EVAL_FINGERPRINT_KEY",
    "FingerprintWriter", "MetricsWriter", "JsonlStepWriter", "RolloutWriter", "read_rollouts", "ReproError",
]

SCHEME = "rlrepro.tensor_digest.v1"
FORMAT = "rlrepro.fingerprint.v1"

#: digest fields of a fingerprint record, in the order diff reports them
FIELDS = ("prompt_ids", "rollout_token_ids", "rollout_logprobs", "rewards", "advantages", "loss", "grad_norm",
          "weights")
#: per-sample digest lists: field -> key of the list in the record
SAMPLE_FIELDS = {"prompt_ids": "sample_prompt_ids", "rollout_token_ids": "sample_token_ids",
                 "rollout_logprobs": "sample_logprobs"}
#: digest fields a step has only when one of its samples is a multi-turn episode (a loss mask or turns): single-turn
#: steps keep exactly the fields above, so their records are those of runs made before multi-turn episodes existed
TURN_FIELDS = ("loss_masks", "turns")
TURN_SAMPLE_FIELDS = {"loss_masks": "sample_loss_masks", "turns": "sample_turns"}
#: the optimizer's state after the step (``optimizer_state_digest``: float32 master weights kept apart from the
#: compute-dtype ``weights``, AdamW's moments and step), present when the trainer fingerprinted it; records of runs
#: from before, or of a trainer that cannot (megatron), lack it, and diff compares it where both runs have it
STATE_FIELDS = ("optimizer_state",)
#: per-sample digests are the first 16 hex digits (64 bits) of the sample's sha256
SAMPLE_DIGEST_HEX = 16

BLOCK_BITS = 20
BLOCK = 1 << BLOCK_BITS            # words per block
_GROUP = 16                        # blocks per pass on accelerators (temporaries: 16 * 8 MiB per buffer)
_GROUP_CPU = 4                     # on CPU (measured best of 1, 4, 16 on 2 and 16 threads)

MASK64 = (1 << 64) - 1
SEED_A1 = 0x243F6A8885A308D3       # digits of pi
SEED_A2 = 0x13198A2E03707344
SEED_K1 = 0xA4093822299F31D0
SEED_K2 = 0x082EFA98EC4E6C89


def splitmix64(x: int) -> int:
    """The splitmix64 finaliser on Python ints (mod 2**64)."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def _splitmix64_np(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


_np_tables: tuple[np.ndarray, np.ndarray] | None = None
_dev_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables_np() -> tuple[np.ndarray, np.ndarray]:
    global _np_tables
    if _np_tables is None:
        j = np.arange(BLOCK, dtype=np.uint64)
        with np.errstate(over="ignore"):
            a1 = _splitmix64_np(j + np.uint64(SEED_A1)) | np.uint64(1)
            a2 = _splitmix64_np(j + np.uint64(SEED_A2))
        _np_tables = (a1, a2)
    return _np_tables


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tabs = _dev_tables.get(device)
    if tabs is None:
        a1, a2 = _tables_np()
        tabs = tuple(torch.from_numpy(a.view(np.int64).copy()).to(device) for a in (a1, a2))
        _dev_tables[device] = tabs
    return tabs


def _block_sums(w: torch.Tensor, a1: torch.Tensor, a2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: int32 [k, n] (n <= BLOCK, rows are blocks); a1/a2: int64 [n]. Returns the int64 sums S1, S2 per row."""
    v = w.to(torch.int64)
    x = torch.bitwise_xor(v, a2)
    x.mul_(x)                      # wrapping int64 arithmetic == arithmetic mod 2**64
    s2 = x.sum(dim=-1)
    del x
    v.mul_(a1)
    s1 = v.sum(dim=-1)
    return s1, s2


def _prepare(t: torch.Tensor) -> tuple[bytes, torch.Tensor, bytes]:
    """Header, the int32 words covering whole 4-byte groups (on t's device), and the 0-3 trailing bytes."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor_digest expects a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"tensor_digest supports dense tensors only, got layout {t.layout}")
    if t.device.type == "meta":
        raise TypeError("tensor_digest: a meta tensor has no data")
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous()
    if (t.storage_offset() * t.element_size()) % 4:
        t = t.clone()  # word views need a 4-byte aligned start
    header = f"{SCHEME}\0{t.dtype}\0{','.join(map(str, t.shape))}\0{t.numel() * t.element_size()}\0".encode()
    b = t.reshape(-1).view(torch.uint8)
    nbytes = b.numel()
    nmain = nbytes - nbytes % 4
    words = b[:nmain].view(torch.int32)
    tail = bytes(b[nmain:].cpu().tolist()) if nmain < nbytes else b""
    return header, words, tail


def _device_sums(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-block (S1, S2) for every block, computed on the words' device; None for no words."""
    n = words.numel()
    if n == 0:
        return None
    a1, a2 = _tables(words.device)
    nfull = n // BLOCK
    group = _GROUP_CPU if words.device.type == "cpu" else _GROUP
    s1s, s2s = [], []
    for g in range(0, nfull, group):
        k = min(group, nfull - g)
        s1, s2 = _block_sums(words[g * BLOCK:(g + k) * BLOCK].view(k, BLOCK), a1, a2)
        s1s.append(s1)
        s2s.append(s2)
    rem = n - nfull * BLOCK
    if rem:
        s1, s2 = _block_sums(words[nfull * BLOCK:].view(1, rem), a1[:rem], a2[:rem])
        s1s.append(s1)
        s2s.append(s2)
    return torch.cat(s1s), torch.cat(s2s)


def _finish(header: bytes, nwords_main: int, s1: Sequence[int], s2: Sequence[int], tail: bytes) -> str:
    s1 = [int(x) & MASK64 for x in s1]
    s2 = [int(x) & MASK64 for x in s2]
    if tail:
        # the last, zero-padded word: fold it into its block's sums exactly as _block_sums would
        i = nwords_main
        r, j = divmod(i, BLOCK)
        v = int.from_bytes(tail + b"\0" * (4 - len(tail)), "little", signed=True) & MASK64
        a1, a2 = _tables_np()
        y = v ^ int(a2[j])
        g = (y * y) & MASK64
        p = (v * int(a1[j])) & MASK64
        if r == len(s1):
            s1.append(0)
            s2.append(0)
        s1[r] = (s1[r] + p) & MASK64
        s2[r] = (s2[r] + g) & MASK64
    h1 = 0
    h2 = 0
    for r, (x1, x2) in enumerate(zip(s1, s2)):
        h1 = (h1 + x1 * (splitmix64(SEED_K1 + r) | 1)) & MASK64
        h2 = (h2 + splitmix64((x2 + splitmix64(SEED_K2 + r)) & MASK64)) & MASK64
    return hashlib.sha256(header + struct.pack("<QQ", h1, h2)).hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    """Exact hex digest of a tensor's dtype, shape and bits; the same on every device (see the module doc)."""
    header, words, tail = _prepare(t)
    sums = _device_sums(words)
    if sums is None:
        return _finish(header, 0, [], [], tail)
    s1, s2 = (x.cpu().tolist() for x in sums)
    return _finish(header, words.numel(), s1, s2, tail)


def tensor_digests(tensors: Iterable[torch.Tensor]) -> list[str]:
    """``[tensor_digest(t) for t in tensors]`` with a single device-to-host transfer per device."""
    prepared = []
    pending: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        header, words, tail = _prepare(t)
        sums = _device_sums(words)
        prepared.append((header, words.numel(), words.device, sums, tail))
        if sums is not None:
            pending.setdefault(words.device, []).extend(sums)
    host: dict[torch.device, list[int]] = {d: torch.cat(v).cpu().tolist() for d, v in pending.items()}
    offsets = {d: 0 for d in host}
    out = []
    for header, n, device, sums, tail in prepared:
        if sums is None:
            out.append(_finish(header, 0, [], [], tail))
            continue
        k = sums[0].numel()
        o = offsets[device]
        vals = host[device]
        out.append(_finish(header, n, vals[o:o + k], vals[o + k:o + 2 * k], tail))
        offsets[device] = o + 2 * k
    return out


def weights_digest(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """Digest of a set of named tensors (a state dict, ``model.named_parameters()``), independent of their
    order: sha256 over ``name, tensor_digest`` sorted by name. Duplicate names are an error."""
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    items.sort(key=lambda kv: kv[0])
    names = [k for k, _ in items]
    for a, b in zip(names, names[1:]):
        if a == b:
            raise ValueError(f"duplicate tensor name {a!r}")
    return _named_digest(b"rlrepro.weights_digest.v1\0", names, tensor_digests(t for _, t in items))


def optimizer_state_digest(named_digests: Mapping[str, str]) -> str:
    """Digest of an optimizer's state from its tensors' ``tensor_digest`` by name (``master/<param>``,
    ``adamw/<param>/<key>``), as :func:`weights_digest` combines them, under its own tag. The tensors are digested
    where they live and the names merged: a sharded optimizer (ZeRO-1) gives the unsharded one's digest."""
    names = sorted(named_digests)
    return _named_digest(b"rlrepro.optimizer_state_digest.v1\0", names, [named_digests[n] for n in names])


def _named_digest(tag: bytes, names: Sequence[str], digests: Sequence[str]) -> str:
    h = hashlib.sha256(tag)
    h.update(struct.pack("<Q", len(names)))
    for name, d in zip(names, digests):
        nb = name.encode("utf-8")
        h.update(struct.pack("<Q", len(nb)) + nb + bytes.fromhex(d))
    return h.hexdigest()


# ------------------------------------------------------------------------------------------- digest_values

_REC_F = np.dtype([("t", "S1"), ("v", "<f8")])
_REC_I = np.dtype([("t", "S1"), ("v", "<i8")])
_REC_B = np.dtype([("t", "S1"), ("v", "u1")])
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


def _records(arr: np.ndarray, rec: np.dtype, tag: bytes) -> bytes:
    out = np.empty(arr.shape[0], dtype=rec)
    out["t"] = tag
    out["v"] = arr
    return b"[" + struct.pack("<Q", arr.shape[0]) + out.tobytes()


def _encode_array(a: np.ndarray, parts: list[bytes]) -> None:
    if a.ndim == 0:
        _encode(a.item() if a.dtype.kind != "f" else float(a), parts)
        return
    if a.ndim > 1:
        parts.append(b"[" + struct.pack("<Q", a.shape[0]))
        for row in a:
            _encode_array(row, parts)
        return
    k = a.dtype.kind
    if k == "f":
        parts.append(_records(a.astype(np.float64), _REC_F, b"f"))
    elif k == "b":
        parts.append(_records(a.astype(np.uint8), _REC_B, b"B"))
    elif k in "iu" and (k == "i" or a.dtype.itemsize < 8 or a.size == 0 or int(a.max()) <= _I64_MAX):
        parts.append(_records(a.astype(np.int64), _REC_I, b"i"))
    else:
        parts.append(b"[" + struct.pack("<Q", a.shape[0]))
        for x in a.tolist():
            _encode(x, parts)


def _tensor_to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.is_floating_point():
        return t.to(torch.float64).numpy()  # every float dtype widens to float64 exactly
    if t.dtype == torch.bool:
        return t.numpy()
    if t.is_complex():
        raise TypeError("digest_values does not take complex tensors; use tensor_digest")
    return t.to(torch.int64).numpy() if t.dtype != torch.uint64 else t.numpy()


def _encode(x: Any, parts: list[bytes]) -> None:
    tx = type(x)
    if tx is float:
        parts.append(b"f" + struct.pack("<d", x))
    elif tx is bool or isinstance(x, np.bool_):
        parts.append(b"B" + (b"\x01" if x else b"\x00"))
    elif tx is int or isinstance(x, (int, np.integer)):
        x = int(x)
        if _I64_MIN <= x <= _I64_MAX:
            parts.append(b"i" + struct.pack("<q", x))
        else:
            nb = (x.bit_length() + 8) // 8
            parts.append(b"I" + struct.pack("<Q", nb) + x.to_bytes(nb, "little", signed=True))
    elif isinstance(x, (float, np.floating)):
        parts.append(b"f" + struct.pack("<d", float(x)))
    elif x is None:
        parts.append(b"N")
    elif isinstance(x, str):
        b = x.encode("utf-8")
        parts.append(b"s" + struct.pack("<Q", len(b)) + b)
    elif isinstance(x, (bytes, bytearray)):
        parts.append(b"y" + struct.pack("<Q", len(x)) + bytes(x))
    elif isinstance(x, (list, tuple)):
        n = len(x)
        if n and all(type(v) is float for v in x):
            parts.append(_records(np.asarray(x, dtype=np.float64), _REC_F, b"f"))
        elif n and all(type(v) is int for v in x):
            try:
                arr = np.asarray(x, dtype=np.int64)
            except OverflowError:
                arr = None
            if arr is not None:
                parts.append(_records(arr, _REC_I, b"i"))
            else:
                parts.append(b"[" + struct.pack("<Q", n))
                for v in x:
                    _encode(v, parts)
        else:
            parts.append(b"[" + struct.pack("<Q", n))
            for v in x:
                _encode(v, parts)
    elif isinstance(x, torch.Tensor):
        _encode_array(_tensor_to_numpy(x), parts)
    elif isinstance(x, np.ndarray):
        if x.dtype.kind not in "fiub":
            raise TypeError(f"digest_values: unsupported array dtype {x.dtype}")
        _encode_array(x, parts)
    elif isinstance(x, Mapping):
        items = []
        for k, v in x.items():
            kp: list[bytes] = []
            _encode(k, kp)
            items.append((b"".join(kp), v))
        items.sort(key=lambda kv: kv[0])
        parts.append(b"{" + struct.pack("<Q", len(items)))
        for kb, v in items:
            parts.append(kb)
            _encode(v, parts)
    else:
        raise TypeError(f"digest_values: unsupported type {type(x).__name__}")


def _values_sha(x: Any) -> "hashlib._Hash":
    parts: list[bytes] = [b"rlrepro.digest_values.v1\0"]
    _encode(x, parts)
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h


def digest_values(x: Any) -> str:
    """Exact hex digest of a Python value: floats by their float64 bits, ints exactly, nested lists/tuples,
    dicts (order-free), str, bool, None; numpy arrays and tensors count as the nested lists of their values
    (every float dtype widens to float64 exactly, so a float32 tensor and the list of its ``.tolist()`` agree).
    Type-tagged: ``1``, ``1.0`` and ``True`` differ; so do ``0.0`` and ``-0.0``."""
    return _values_sha(x).hexdigest()


# ------------------------------------------------------------------------------------------- fingerprints


def _per_sample(samples: Sequence[Any]) -> tuple[str, list[str]]:
    """(field digest, per-sample short digests). The field digest is sha256 over the count and the samples' full
    sha256 digests, so it covers every sample exactly."""
    h = hashlib.sha256(b"rlrepro.samples.v1\0")
    h.update(struct.pack("<Q", len(samples)))
    short = []
    for s in samples:
        d = _values_sha(s).digest()
        h.update(d)
        short.append(d.hex()[:SAMPLE_DIGEST_HEX])
    return h.hexdigest(), short


def _scalar(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"expected a scalar, got a tensor of shape {tuple(x.shape)}")
        x = x.detach().cpu().reshape(())
        return float(x.to(torch.float64)) if x.is_floating_point() else int(x)
    if isinstance(x, np.generic):
        return x.item()
    return x


class StepFingerprint:
    """Builds one step's fingerprint record as its parts become available::

        fp = StepFingerprint(step)
        fp.set_rollouts(prompt_ids=..., token_ids=..., logprobs=..., rewards=..., advantages=...)
        fp.set_train(loss=..., grad_norm=...)
        fp.set_weights(model.named_parameters())     # or a precomputed weights_digest hex, or None
        FingerprintWriter(run_dir).write(fp.to_dict())
    """

    def __init__(self, step: int):
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError("step must be an int")
        self.step = step
        self._d: dict[str, Any] = {}

    def set_rollouts(self, *, prompt_ids: Sequence[Any], token_ids: Sequence[Any], logprobs: Sequence[Any],
                     rewards: Any, advantages: Any, loss_masks: Sequence[Any] | None = None,
                     turns: Sequence[Any] | None = None) -> "StepFingerprint":
        n = len(token_ids)
        if len(logprobs) != n or len(prompt_ids) != n:
            raise ValueError(f"per-sample lengths differ: prompt_ids {len(prompt_ids)}, token_ids {n}, "
                             f"logprobs {len(logprobs)}")
        for name, samples in (("prompt_ids", prompt_ids), ("rollout_token_ids", token_ids),
                              ("rollout_logprobs", logprobs)):
            self._d[name], self._d[SAMPLE_FIELDS[name]] = _per_sample(samples)
        self._d["rewards"] = digest_values(rewards)
        self._d["advantages"] = digest_values(advantages)
        self._d["num_samples"] = n
        for name in TURN_FIELDS:
            self._d.pop(name, None)
            self._d.pop(TURN_SAMPLE_FIELDS[name], None)
        masks = [None] * n if loss_masks is None else [_mask(m) for m in loss_masks]
        spans = [None] * n if turns is None else [None if t is None else turn_spans(t) for t in turns]
        if len(masks) != n or len(spans) != n:
            raise ValueError(f"per-sample lengths differ: token_ids {n}, loss_masks {len(masks)}, turns {len(spans)}")
        if any(m is not None for m in masks) or any(t is not None for t in spans):
            # multi-turn: a sample without a mask or turns counts as None (single-turn steps get no such fields)
            for name, samples in (("loss_masks", masks), ("turns", spans)):
                self._d[name], self._d[TURN_SAMPLE_FIELDS[name]] = _per_sample(samples)
        return self

    def set_train(self, *, loss: Any, grad_norm: Any) -> "StepFingerprint":
        self._d["loss"] = digest_values(_scalar(loss))
        self._d["grad_norm"] = digest_values(_scalar(grad_norm))
        return self

    def set_weights(self, weights: Any) -> "StepFingerprint":
        if weights is None or isinstance(weights, str):
            self._d["weights"] = weights
        else:
            self._d["weights"] = weights_digest(weights)
        return self

    def set_optimizer_state(self, digest: str | None) -> "StepFingerprint":
        """An ``optimizer_state_digest`` hex; None: not fingerprinted (the record has no such field)."""
        if digest is None:
            self._d.pop("optimizer_state", None)
        else:
            self._d["optimizer_state"] = digest
        return self

    def to_dict(self) -> dict:
        missing = [f for f in FIELDS if f not in self._d]
        if missing:
            raise ValueError(f"step {self.step}: fingerprint fields not set: {', '.join(missing)}")
        out: dict[str, Any] = {"step": self.step, "format": FORMAT}
        for f in FIELDS:
            out[f] = self._d[f]
        out.update((f, self._d[f]) for f in STATE_FIELDS if f in self._d)
        out["num_samples"] = self._d["num_samples"]
        for key in SAMPLE_FIELDS.values():
            out[key] = self._d[key]
        for f in TURN_FIELDS:
            if f in self._d:
                out[f] = self._d[f]
                out[TURN_SAMPLE_FIELDS[f]] = self._d[TURN_SAMPLE_FIELDS[f]]
        return out


def fingerprint_step(step: int, *, prompt_ids: Sequence[Any], token_ids: Sequence[Any], logprobs: Sequence[Any],
                     rewards: Any, advantages: Any, loss: Any, grad_norm: Any, weights: Any,
                     loss_masks: Sequence[Any] | None = None, turns: Sequence[Any] | None = None,
                     optimizer_state: str | None = None) -> dict:
    """One step's fingerprint record (a JSON-able dict).

    ``prompt_ids``, ``token_ids`` and ``logprobs`` are per-sample sequences (lists or 1-D tensors), ordered by
    (prompt uid, sample index); ``rewards`` / ``advantages`` per-sample values (any shape ``digest_values``
    takes); ``loss`` / ``grad_norm`` scalars (float or 1-element tensor); ``weights`` named tensors (state dict or
    ``named_parameters()``), a precomputed ``weights_digest`` hex string, or None when not fingerprinted.
    ``loss_masks`` / ``turns``: per sample, the 0/1 loss mask and the turns (``Turn`` objects or rollout-file
    dicts), or None for a single-turn sample; when any sample has one, the record gets the ``TURN_FIELDS`` (the
    masks, and the turns' roles and token spans); otherwise it is exactly the record of a single-turn step.
    ``optimizer_state``: an ``optimizer_state_digest`` hex (``STATE_FIELDS``), or None (no such field).
    """
    return (StepFingerprint(step)
            .set_rollouts(prompt_ids=prompt_ids, token_ids=token_ids, logprobs=logprobs, rewards=rewards,
                          advantages=advantages, loss_masks=loss_masks, turns=turns)
            .set_train(loss=loss, grad_norm=grad_norm)
            .set_weights(weights)
            .set_optimizer_state(optimizer_state)
            .to_dict())


def _mask(m: Any) -> list[int] | None:
    """A loss mask as plain ints (a bool or tensor mask and its 0/1 list give the same digest)."""
    if m is None:
        return None
    return [int(x) for x in (m.tolist() if hasattr(m, "tolist") else m)]


def _sample_fields(s: Any) -> tuple[Any, Any, Any, Any, Any, Any, Any]:
    """(prompt ids, completion ids, rollout logprobs, reward, advantage, loss mask, turns) of a ``Sample`` or a
    rollout dict."""
    if isinstance(s, Sample):
        return (s.prompt_token_ids, s.completion_token_ids, s.rollout_logprobs, s.reward, s.advantage, s.loss_mask,
                s.turns)
    return (s["prompt_token_ids"], s["token_ids"], s["logprobs"], s["reward"], s["advantage"], s.get("loss_mask"),
            s.get("turns"))


def fingerprint_from_samples(step: int, samples: Sequence[Sample | Mapping[str, Any]], *, loss: Any, grad_norm: Any,
                             weights: Any, optimizer_state: str | None = None) -> dict:
    """``fingerprint_step`` from the same samples that ``RolloutWriter.write`` takes, so the fingerprint and the
    rollout file cannot disagree on sample order. ``samples``: :class:`~rlrepro.samples.Sample` objects
    (``prompt_token_ids``, ``completion_token_ids``, ``rollout_logprobs``, ``reward``, ``advantage``) or rollout
    dicts (``prompt_token_ids``, ``token_ids``, ``logprobs``, ``reward``, ``advantage``); equal values give
    equal digests either way. Multi-turn samples add their ``loss_mask`` and ``turns`` (``TURN_FIELDS``; a step
    of single-turn samples has the same record as before they existed). The decoded text is not fingerprinted (it
    is a function of the token ids)."""
    fields = [_sample_fields(s) for s in samples]
    return fingerprint_step(
        step,
        prompt_ids=[f[0] for f in fields],
        token_ids=[f[1] for f in fields],
        logprobs=[f[2] for f in fields],
        rewards=[f[3] for f in fields],
        advantages=[f[4] for f in fields],
        loss=loss, grad_norm=grad_norm, weights=weights, optimizer_state=optimizer_state,
        loss_masks=[f[5] for f in fields], turns=[f[6] for f in fields])


def eval_fingerprint(samples: Iterable[Sequence[Any]]) -> str:
    """The fingerprint of one evaluation (``eval.every``; metrics.jsonl ``EVAL_FINGERPRINT_KEY``): ``samples`` are
    ``(key, token_ids, logprobs)`` per eval request, or ``(key, token_ids, logprobs, loss_mask)`` for an episode,
    in any order; ``key`` is the request's ``(prompt uid, sample index)``. sha256 over ``"rlrepro.eval.v1\\0"``, the
    count and, in key order, each request's full sha256 of ``digest_values([key, token_ids, logprobs, loss_mask])``
    (``loss_mask`` None for a single-turn request), so two evaluations agree exactly when every completion's
    tokens and logprobs do."""
    items = sorted((tuple(s) for s in samples), key=lambda s: tuple(s[0]))
    h = hashlib.sha256(b"rlrepro.eval.v1\0")
    h.update(struct.pack("<Q", len(items)))
    for key, token_ids, logprobs, *mask in items:
        h.update(_values_sha([list(key), token_ids, logprobs, _mask(mask[0]) if mask else None]).digest())
    return h.hexdigest()

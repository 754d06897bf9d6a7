"""Digests, fingerprint records and the run-directory writers (rlrepro.repro.fingerprint / records)."""
import gzip
import hashlib
import json
import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlrepro.repro import fingerprint as F
from rlrepro.repro.fingerprint import (
    FingerprintWriter,
    MetricsWriter,
    RolloutWriter,
    StepFingerprint,
    digest_values,
    fingerprint_from_samples,
    fingerprint_step,
    read_rollouts,
    tensor_digest,
    tensor_digests,
    weights_digest,
)
from rlrepro.repro.records import ReproError, read_step_records

# ---------------------------------------------------------------- the v1 scheme, re-implemented from its spec

M64 = (1 << 64) - 1
BLOCK = 1 << 20
SEED_A1, SEED_A2 = 0x243F6A8885A308D3, 0x13198A2E03707344
SEED_K1, SEED_K2 = 0xA4093822299F31D0, 0x082EFA98EC4E6C89


def sm64(x):
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _raw(t):
    t = t.detach().contiguous().cpu()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    header = f"rlrepro.tensor_digest.v1\0{t.dtype}\0{','.join(map(str, t.shape))}\0{len(data)}\0".encode()
    return header, data + b"\0" * (-len(data) % 4)


def _final(header, s1, s2):
    h1 = h2 = 0
    for r in sorted(s1):
        h1 = (h1 + s1[r] * (sm64(SEED_K1 + r) | 1)) & M64
        h2 = (h2 + sm64((s2[r] + sm64(SEED_K2 + r)) & M64)) & M64
    return hashlib.sha256(header + struct.pack("<QQ", h1, h2)).hexdigest()


def ref_digest_python(t):
    """Word by word in Python ints: the spec of docs/RUN_DIRECTORY.md, for small tensors."""
    header, data = _raw(t)
    s1, s2 = {}, {}
    for i, (w,) in enumerate(struct.iter_unpack("<i", data)):
        r, j = divmod(i, BLOCK)
        v = w & M64
        x = v ^ sm64(SEED_A2 + j)
        s1[r] = (s1.get(r, 0) + v * (sm64(SEED_A1 + j) | 1)) & M64
        s2[r] = (s2.get(r, 0) + x * x) & M64
    return _final(header, s1, s2)


def _sm64_np(x):
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def ref_digest_numpy(t):
    """The same spec, vectorised with numpy uint64 (wrapping) arithmetic, for multi-block tensors."""
    header, data = _raw(t)
    v = np.frombuffer(data, dtype="<i4").astype(np.int64).view(np.uint64)
    if v.size == 0:
        return _final(header, {}, {})
    j = (np.arange(v.size, dtype=np.uint64) % np.uint64(BLOCK))
    with np.errstate(over="ignore"):
        a1 = _sm64_np(j + np.uint64(SEED_A1)) | np.uint64(1)
        a2 = _sm64_np(j + np.uint64(SEED_A2))
        p = v * a1
        x = v ^ a2
        q = x * x
    starts = np.arange(0, v.size, BLOCK)
    s1 = {r: int(s) for r, s in enumerate(np.add.reduceat(p, starts))}
    s2 = {r: int(s) for r, s in enumerate(np.add.reduceat(q, starts))}
    return _final(header, s1, s2)


SMALL = [
    torch.zeros(0),
    torch.tensor(1.5),
    torch.arange(7, dtype=torch.bfloat16) / 3,
    torch.randn(5, 3, generator=torch.Generator().manual_seed(0)),
    torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).to(torch.float16),
    torch.tensor([True, False, True]),
    torch.arange(-5, 6, dtype=torch.int64),
    torch.arange(9, dtype=torch.uint8),
    torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2)),
]


@pytest.mark.parametrize("t", SMALL, ids=lambda t: f"{t.dtype}{tuple(t.shape)}")
def test_matches_python_and_numpy_reference(t):
    d = tensor_digest(t)
    assert d == ref_digest_python(t) == ref_digest_numpy(t)
    assert len(d) == 64 and int(d, 16) >= 0


def test_multi_block_matches_numpy_reference_and_is_chunking_free(monkeypatch):
    g = torch.Generator().manual_seed(3)
    t = torch.randn(3 * BLOCK + 123, generator=g)
    d = tensor_digest(t)
    assert d == ref_digest_numpy(t)
    monkeypatch.setattr(F, "_GROUP_CPU", 2)   # another grouping of blocks gives the same sums
    assert tensor_digest(t) == d
    tb = torch.randn(BLOCK + 3, generator=g).to(torch.bfloat16)   # odd byte count: a padded tail word
    assert tensor_digest(tb) == ref_digest_numpy(tb)


def test_every_single_bit_flip_changes_the_digest():
    t = (torch.arange(7, dtype=torch.bfloat16) - 2.5) / 3   # 14 bytes: 3 words and a 2-byte tail
    raw = t.view(torch.uint8).clone()
    seen = {tensor_digest(t)}
    for byte in range(raw.numel()):
        for bit in range(8):
            flipped = raw.clone()
            flipped[byte] ^= 1 << bit
            seen.add(tensor_digest(flipped.view(torch.bfloat16)))
    assert len(seen) == 1 + 8 * raw.numel()


def test_bit_flips_in_later_blocks():
    t = torch.randn(2 * BLOCK + 5, generator=torch.Generator().manual_seed(4))
    d = tensor_digest(t)
    for idx, bit in [(0, 0), (BLOCK - 1, 31), (BLOCK, 7), (2 * BLOCK + 4, 22)]:
        u = t.clone()
        u.view(torch.int32)[idx] ^= (1 << bit) if bit < 31 else -(1 << 31)
        assert tensor_digest(u) != d, (idx, bit)
    # swapping two words is not a no-op either
    u = t.clone()
    u[[10, BLOCK + 10]] = u[[BLOCK + 10, 10]]
    assert tensor_digest(u) != d


def test_dtype_shape_layout():
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(5))
    assert tensor_digest(x) != tensor_digest(x.reshape(6, 4))
    assert tensor_digest(x) != tensor_digest(x.view(torch.int32))
    assert tensor_digest(x.t()) == tensor_digest(x.t().contiguous())       # values decide, not strides
    assert tensor_digest(x.t()) != tensor_digest(x)
    h = torch.arange(11, dtype=torch.float16)
    assert tensor_digest(h[3:]) == tensor_digest(h[3:].clone())             # 6-byte storage offset
    assert tensor_digest(torch.tensor(0.0)) != tensor_digest(torch.tensor(-0.0))
    assert tensor_digest(x.requires_grad_()) == tensor_digest(x.detach())
    assert tensor_digests([x, h, torch.zeros(0)]) == [tensor_digest(x), tensor_digest(h), tensor_digest(torch.zeros(0))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_cuda_digests_agree():
    g = torch.Generator().manual_seed(6)
    cases = [torch.randn(3 * BLOCK + 7, generator=g).to(torch.bfloat16), torch.randn(17 * BLOCK + 1, generator=g),
             torch.randn(33, 65, generator=g).t(), torch.randint(0, 151936, (1000,), generator=g),
             torch.arange(5, dtype=torch.uint8), torch.zeros(0)] + SMALL
    for t in cases:
        assert tensor_digest(t) == tensor_digest(t.cuda()), (t.dtype, tuple(t.shape))
    sd = {f"w{i}": t for i, t in enumerate(cases)}
    assert weights_digest(sd) == weights_digest({k: v.cuda() for k, v in sd.items()})


# ---------------------------------------------------------------------------------------------- values


def test_digest_values_exact_and_typed():
    a = 0.1 + 0.2
    assert digest_values([a]) != digest_values([0.3])
    assert digest_values([1.0]) != digest_values([1]) != digest_values([True])
    assert digest_values(0.0) != digest_values(-0.0)
    assert digest_values(float("nan")) == digest_values(float("nan"))
    assert digest_values([[1, 2], [3]]) != digest_values([[1], [2, 3]])
    assert digest_values([1, 2**70]) != digest_values([1, 2**70 + 1])
    assert digest_values({"a": 1, "b": [2.5]}) == digest_values({"b": [2.5], "a": 1})
    # tensors and numpy arrays hash as the lists of their values; float32 widens exactly
    lp = torch.randn(50, generator=torch.Generator().manual_seed(7))
    assert digest_values(lp) == digest_values(lp.tolist()) == digest_values(lp.numpy())
    assert digest_values(lp.to(torch.bfloat16)) == digest_values(lp.to(torch.bfloat16).float().tolist())
    ids = torch.randint(0, 1000, (3, 9), generator=torch.Generator().manual_seed(8))
    assert digest_values(ids) == digest_values(ids.tolist()) == digest_values([r for r in ids])
    assert digest_values([np.float32(0.5), 1.5]) == digest_values([0.5, 1.5])
    # one ulp
    assert digest_values([1.0]) != digest_values([math.nextafter(1.0, 2.0)])
    with pytest.raises(TypeError):
        digest_values(object())


def test_weights_digest_order_free_and_exact():
    g = torch.Generator().manual_seed(9)
    sd = {"b.weight": torch.randn(4, 4, generator=g), "a.bias": torch.randn(4, generator=g)}
    d = weights_digest(sd)
    assert d == weights_digest(list(reversed(list(sd.items()))))
    sd2 = {k: v.clone() for k, v in sd.items()}
    sd2["a.bias"].view(torch.int32)[2] ^= 1
    assert weights_digest(sd2) != d
    assert weights_digest({"x.weight": sd["b.weight"], "a.bias": sd["a.bias"]}) != d   # names count
    model = torch.nn.Linear(3, 2)
    assert weights_digest(model.named_parameters()) == weights_digest(model.state_dict())
    with pytest.raises(ValueError):
        weights_digest([("a", sd["a.bias"]), ("a", sd["a.bias"])])


# ---------------------------------------------------------------------------------------- fingerprints


def _samples(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = 3 + i
        out.append({"prompt_uid": f"p{i // 2}", "sample_index": i % 2,
                    "prompt_token_ids": [1, 2, 3 + i // 2],
                    "token_ids": torch.randint(0, 100, (L,), generator=g).tolist(),
                    "logprobs": (-torch.rand(L, generator=g)).tolist(),
                    "reward": float(i % 2), "advantage": (i % 2) - 0.5})
    return out


def test_fingerprint_step_fields_and_sensitivity():
    s = _samples()
    w = {"w": torch.ones(3)}
    fp = fingerprint_from_samples(3, s, loss=torch.tensor(0.25), grad_norm=1.5, weights=w)
    assert fp["step"] == 3 and fp["num_samples"] == 4
    for f in F.FIELDS:
        assert isinstance(fp[f], str) and len(fp[f]) == 64
    assert len(fp["sample_token_ids"]) == len(fp["sample_logprobs"]) == len(fp["sample_prompt_ids"]) == 4
    assert all(len(x) == F.SAMPLE_DIGEST_HEX for x in fp["sample_token_ids"])
    json.dumps(fp)
    # lists and tensors give the same record
    fp_t = fingerprint_step(3, prompt_ids=[torch.tensor(x["prompt_token_ids"]) for x in s],
                            token_ids=[torch.tensor(x["token_ids"]) for x in s],
                            logprobs=[torch.tensor(x["logprobs"], dtype=torch.float64) for x in s],
                            rewards=torch.tensor([x["reward"] for x in s]),
                            advantages=[x["advantage"] for x in s], loss=0.25, grad_norm=torch.tensor(1.5),
                            weights=weights_digest(w))
    assert fp_t == fp
    # one token of sample 2 changes only that sample's digest and the field digest
    s2 = _samples()
    s2[2]["token_ids"][1] += 1
    fp2 = fingerprint_from_samples(3, s2, loss=0.25, grad_norm=1.5, weights=w)
    assert [f for f in F.FIELDS if fp2[f] != fp[f]] == ["rollout_token_ids"]
    assert [i for i, (a, b) in enumerate(zip(fp["sample_token_ids"], fp2["sample_token_ids"])) if a != b] == [2]
    # incremental builder
    b = StepFingerprint(3).set_rollouts(prompt_ids=[x["prompt_token_ids"] for x in s],
                                        token_ids=[x["token_ids"] for x in s], logprobs=[x["logprobs"] for x in s],
                                        rewards=[x["reward"] for x in s], advantages=[x["advantage"] for x in s])
    with pytest.raises(ValueError):
        b.to_dict()
    assert b.set_train(loss=0.25, grad_norm=1.5).set_weights(w).to_dict() == fp
    with pytest.raises(ValueError):
        fingerprint_step(0, prompt_ids=[[1]], token_ids=[[1], [2]], logprobs=[[0.0]], rewards=[0.0],
                         advantages=[0.0], loss=0.0, grad_norm=0.0, weights=None)


# ---------------------------------------------------------------------------------------------- writers


def test_jsonl_writer_append_truncate_and_torn_line(tmp_path):
    w = FingerprintWriter(tmp_path)
    for step in range(1, 6):
        w.write({"step": step, "x": step * 0.1})
    with pytest.raises(ReproError):
        w.write({"step": 3, "x": 0.0})
    assert w.truncate_from(4) == 2
    w.write({"step": 4, "x": 0.4})
    recs = read_step_records(tmp_path / "fingerprints.jsonl")
    assert list(recs) == [1, 2, 3, 4] and recs[3]["x"] == 0.30000000000000004
    # a crash mid-line: appending refuses, truncate_from repairs
    with open(tmp_path / "fingerprints.jsonl", "a") as f:
        f.write('{"step": 5, "x"')
    w2 = FingerprintWriter(tmp_path)
    assert w2.last_step == 4
    with pytest.raises(ReproError, match="torn"):
        w2.write({"step": 5})
    assert w2.truncate_from(5) == 1
    w2.write({"step": 5, "x": float("nan"), "t": torch.tensor(2.5), "n": np.float32(0.5)})
    recs = read_step_records(tmp_path / "fingerprints.jsonl")
    assert list(recs) == [1, 2, 3, 4, 5] and math.isnan(recs[5]["x"]) and recs[5]["t"] == 2.5
    # a malformed line in the middle is an error, not silently dropped
    lines = (tmp_path / "fingerprints.jsonl").read_text().splitlines()
    lines[1] = "{oops"
    (tmp_path / "fingerprints.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ReproError, match=r"fingerprints.jsonl:2"):
        FingerprintWriter(tmp_path)
    m = MetricsWriter(tmp_path)
    m.write({"step": 0, "train/loss": 1.0})
    assert (tmp_path / "metrics.jsonl").exists()


def test_rollout_writer_atomic_and_byte_reproducible(tmp_path):
    s = _samples()
    s[0]["logprobs"] = torch.tensor(s[0]["logprobs"], dtype=torch.float32)   # tensors become lists, exactly
    rw = RolloutWriter(tmp_path / "a")
    p = rw.write(7, s)
    assert p.name == "step_000007.jsonl.gz" and p.parent.name == "rollouts"
    assert [x.name for x in p.parent.iterdir()] == [p.name]                 # no temp files left behind
    back = read_rollouts(tmp_path / "a", 7)
    assert back[0]["logprobs"] == s[0]["logprobs"].tolist()
    assert back[1:] == s[1:]
    p2 = RolloutWriter(tmp_path / "b").write(7, s)
    assert p.read_bytes() == p2.read_bytes()                               # no mtime / name in the gzip header
    assert read_rollouts(tmp_path / "a", 8) is None
    with pytest.raises(ValueError):
        rw.write(8, [{"prompt_uid": "x"}])
    rw.write(9, s)
    assert [x.name for x in rw.truncate_from(8)] == ["step_000009.jsonl.gz"]
    p.write_bytes(gzip.compress(b'{"a": 1}\n{bad\n'))
    with pytest.raises(ReproError, match=r"step_000007.jsonl.gz:2"):
        read_rollouts(tmp_path / "a", 7)


# ------------------------------------------------------------------------------------------- properties


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=1, max_size=48), dtype=st.sampled_from([torch.uint8, torch.int16, torch.bfloat16]),
       flip=st.integers(min_value=0))
def test_property_reference_and_bit_flip(data, dtype, flip):
    esize = torch.empty(0, dtype=dtype).element_size()
    data = data[: len(data) - len(data) % esize] or bytes(esize)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
    d = tensor_digest(t)
    assert d == ref_digest_python(t)
    bit = flip % (8 * len(data))
    u = bytearray(data)
    u[bit // 8] ^= 1 << (bit % 8)
    assert tensor_digest(torch.frombuffer(u, dtype=torch.uint8).view(dtype)) != d

"""Session 36's audit of the RL algorithm math: every advantage estimator, policy loss, aggregation, KL estimator,
the entropy term, the behaviour weights of the decoupled objective (TIS / MIS) and DAPO's overlong shaping, each
against an INDEPENDENT float64 reference written here from the papers' definitions (plain Python: exact
``Fraction`` means and centring, ``math.exp`` / ``math.log`` per token, loops over sequences), never by calling
rlrepro's helpers. Random inputs, plus the edge cases: groups of equal rewards, group size 2, all-masked rows,
negative advantages under the dual clip, ratios far outside the clip range, and the gradients of GSPO and CISPO
(autograd against the analytic form; GSPO also against its token variant GSPO-token with the stop-gradient).

This is a check against a reference, not the bitwise promise: float64 inputs, tolerance 1e-12.
The reference follows rlrepro's documented choices where the papers leave a choice open (docs/TRAINER.md): the
log importance ratio bounded at +-20 (verl's too; tested on its own), a sequence with no trained token counting
in ``S`` of the ``seq-mean-*`` modes, the population std by default.
"""
import math
import zlib
from fractions import Fraction

import pytest
import torch

from rlrepro.data import overlong_penalty
from rlrepro.trainer import aggregate, behaviour_weights, compute_advantages, kl_penalty, policy_loss

TOL = dict(rtol=1e-12, atol=1e-12)
EPS = 1e-6  # compute_advantages' default eps, added to the std (verl's epsilon)
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
C_NORM = 11  # seq-mean-token-sum-norm's constant (>= the longest row below)


# ------------------------------------------------------------------------------------------ reference: advantages
def _mean(xs):
    return sum((Fraction(x) for x in xs), Fraction(0)) / len(xs)


def _std(xs, sample: bool) -> float:
    m = _mean(xs)
    return math.sqrt(sum(((Fraction(x) - m) ** 2 for x in xs), Fraction(0)) / (len(xs) - (1 if sample else 0)))


def _normalise(centred, sample: bool) -> list[float]:
    """(c - mean(c)) / (std(c) + eps) over a list of exact Fractions; 0 where the list is constant."""
    m = _mean(centred)
    if all(c == centred[0] for c in centred):
        return [0.0] * len(centred)
    s = _std(centred, sample)
    return [float(c - m) / (s + EPS) for c in centred]


def ref_advantages(rewards: list[list[float]], mode: str, std: str = "population") -> list[list[float]]:
    """The estimators from their papers (module docstring of rlrepro.trainer.advantages names them)."""
    sample = std == "sample"
    g = len(rewards[0])
    if mode == "grpo":  # DeepSeekMath 4.1.2: (r - mean_g) / (std_g + eps)
        return [_normalise([Fraction(r) for r in row], sample) for row in rewards]
    if mode == "dr_grpo":  # Liu et al. 2025 3.1: r - mean_g, no std
        return [[float(Fraction(r) - _mean(row)) for r in row] for row in rewards]
    if mode == "rloo":  # Kool et al. 2019: r_i - mean of the OTHER samples of the group
        return [[float(Fraction(row[i]) - sum(Fraction(row[j]) for j in range(g) if j != i) / (g - 1))
                 for i in range(g)] for row in rewards]
    flat = [Fraction(r) for row in rewards for r in row]
    if mode == "reinforce_pp_baseline":  # Hu et al. 2025: A' = r - mean_g, then the batch normalisation
        flat = [Fraction(r) - _mean(row) for row in rewards for r in row]
    out = _normalise(flat, sample)  # reinforce_pp: the batch normalisation of the raw rewards
    return [out[i * g:(i + 1) * g] for i in range(len(rewards))]


def _seed(*parts) -> int:
    """A fixed seed per test case (not ``hash``, which Python salts per process)."""
    return zlib.crc32(repr(parts).encode())


def _random_rewards(gen, prompts: int, g: int, kind: str) -> list[list[float]]:
    if kind == "binary":
        x = (torch.rand(prompts, g, generator=gen, dtype=torch.float64) < 0.5).double()
    else:
        x = torch.randn(prompts, g, generator=gen, dtype=torch.float64) * 3.0 + 0.7
    rows = x.tolist()
    rows[0] = [rows[0][0]] * g  # a group of equal rewards
    if prompts > 2:
        rows[2] = [0.1] * g  # equal rewards whose float mean is not exactly 0.1
    return rows


ADV_CASES = [(mode, std) for mode in ("grpo", "reinforce_pp", "reinforce_pp_baseline") for std in
             ("population", "sample")] + [("dr_grpo", "population"), ("rloo", "population")]


@pytest.mark.parametrize("mode,std", ADV_CASES)
@pytest.mark.parametrize("g", [2, 3, 8])
@pytest.mark.parametrize("kind", ["binary", "gaussian"])
def test_advantages_match_the_reference(mode, std, g, kind):
    gen = torch.Generator().manual_seed(_seed(mode, std, g, kind))
    rewards = _random_rewards(gen, 5, g, kind)
    got = compute_advantages(torch.tensor(rewards, dtype=torch.float64), mode, std=std)
    torch.testing.assert_close(got, torch.tensor(ref_advantages(rewards, mode, std), dtype=torch.float64), **TOL)
    if mode in ("grpo", "dr_grpo", "rloo"):  # a group of equal rewards: exactly 0 (its rows 0 and 2)
        assert torch.equal(got[0], torch.zeros(g, dtype=torch.float64))
        assert torch.equal(got[2], torch.zeros(g, dtype=torch.float64))


def test_advantage_edge_cases_against_the_reference():
    # group size 2 (GRPO's population std of [1, 0] is 0.5: +-0.5 / (0.5 + eps))
    two = [[1.0, 0.0], [0.25, 0.75], [3.0, 3.0]]
    for mode, std in ADV_CASES:
        got = compute_advantages(torch.tensor(two, dtype=torch.float64), mode, std=std)
        torch.testing.assert_close(got, torch.tensor(ref_advantages(two, mode, std), dtype=torch.float64), **TOL)
    # RLOO at G = 2 is r_i - r_other; Dr. GRPO's is half of it
    got = compute_advantages(torch.tensor(two, dtype=torch.float64), "rloo")
    assert got.tolist() == [[1.0, -1.0], [-0.5, 0.5], [0.0, 0.0]]
    # a whole batch of equal rewards: every estimator gives exactly 0
    same = torch.full((3, 4), 0.3, dtype=torch.float64)
    for mode, std in ADV_CASES:
        assert torch.equal(compute_advantages(same, mode, std=std), torch.zeros(3, 4, dtype=torch.float64))
    # group of one (Python API only: runs need group_size >= 2): the group-mean baseline is the sample itself
    one = [[1.0], [0.0], [4.0]]
    for mode in ("grpo", "dr_grpo", "reinforce_pp", "reinforce_pp_baseline"):
        got = compute_advantages(torch.tensor(one, dtype=torch.float64), mode)
        torch.testing.assert_close(got, torch.tensor(ref_advantages(one, mode), dtype=torch.float64), **TOL)


# ------------------------------------------------------------------------------------------------ reference: loss
def _clip(x, lo, hi):
    return min(max(x, lo), hi)


def _ratio(lp, old):
    return math.exp(_clip(lp - old, -20.0, 20.0))  # the documented +-20 bound (verl's); inputs stay inside it


def _agg_weights(mask: list[list[bool]], agg: str, num_tokens=None, num_seqs=None) -> list[list[float]]:
    """d agg / d x_it: the weight of each token in the aggregation (0 outside the mask)."""
    n = sum(sum(row) for row in mask) if num_tokens is None else num_tokens
    s = len(mask) if num_seqs is None else num_seqs
    out = []
    for row in mask:
        length = sum(row)
        per = {"token-mean": 1.0 / max(n, 1), "seq-mean-token-mean": 1.0 / (s * max(length, 1)),
               "seq-mean-token-sum": 1.0 / s, "seq-mean-token-sum-norm": 1.0 / (s * C_NORM)}[agg]
        out.append([per if m else 0.0 for m in row])
    return out


def ref_aggregate(x, mask, agg, num_tokens=None, num_seqs=None) -> float:
    """token-mean: sum x / sum L (DAPO); seq-mean-token-mean: (1/S) sum_i (1/L_i) sum_t x (GRPO);
    seq-mean-token-sum: (1/S) sum_i sum_t x (verl); seq-mean-token-sum-norm: (1/S) sum_i (1/C) sum_t x (Dr. GRPO)."""
    n = sum(sum(row) for row in mask) if num_tokens is None else num_tokens
    s = len(mask) if num_seqs is None else num_seqs
    if agg == "token-mean":
        return math.fsum(v for xr, mr in zip(x, mask) for v, m in zip(xr, mr) if m) / max(n, 1)
    per = []
    for xr, mr in zip(x, mask):
        total = math.fsum(v for v, m in zip(xr, mr) if m)
        per.append({"seq-mean-token-mean": total / max(sum(mr), 1), "seq-mean-token-sum": total,
                    "seq-mean-token-sum-norm": total / C_NORM}[agg])
    return math.fsum(per) / s


def ref_pg(lp, old, adv, mask, mode, cl, ch, dual=0.0):
    """Per-token policy loss and its analytic gradient, lists [B][T]: d pg_it / d logp_it (gspo: d pg_i / d logp_it,
    pg_i the sequence's one term, on each of its tokens)."""
    pg, grad = [], []
    for i, (lr, orow, mr) in enumerate(zip(lp, old, mask)):
        a = adv[i]
        if mode == "gspo":  # Zheng et al. 2025: s_i = exp(mean_t log ratio), one clipped term per sequence
            length = sum(mr)
            mean_lr = math.fsum(x - o for x, o, m in zip(lr, orow, mr) if m) / max(length, 1)
            s = math.exp(_clip(mean_lr, -20.0, 20.0))
            unclipped, clipped = -a * s, -a * _clip(s, 1 - cl, 1 + ch)
            value = max(unclipped, clipped)
            # d(-A s_i) / d logp_it = -A s_i / L_i on each trained token; 0 where the clip is the active term
            g = -a * s / max(length, 1) if not clipped > unclipped else 0.0
            pg.append([value] * len(lr))
            grad.append([g if m else 0.0 for m in mr])
            continue
        prow, grow = [], []
        for x, o in zip(lr, orow):
            r = _ratio(x, o)
            if mode == "cispo":  # MiniMax-M1 3.1: -sg(clip(r)) A logp
                w = _clip(r, 1 - cl, 1 + ch)
                prow.append(-w * a * x)
                grow.append(-w * a)
                continue
            unclipped, clipped = -a * r, -a * _clip(r, 1 - cl, 1 + ch)  # PPO eq. 7 (negated), DAPO clip-higher
            value, g = (clipped, 0.0) if clipped > unclipped else (unclipped, -a * r)
            if dual and a < 0 and -a * dual < value:  # Ye et al. 2020: bounded by -A c for A < 0 only
                value, g = -a * dual, 0.0
            prow.append(value)
            grow.append(g)
        pg.append(prow)
        grad.append(grow)
    return pg, grad


def ref_kl(lp, ref, estimator):
    """Schulman 2020 with r = pi_ref / pi (samples of pi): k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r;
    returns the value and d / d logp."""
    log_r = ref - lp
    r = math.exp(log_r)
    return {"k1": (-log_r, 1.0), "k2": (0.5 * log_r * log_r, -log_r), "k3": (r - 1.0 - log_r, 1.0 - r)}[estimator]


def _random_batch(seed, b=6, t=9, scale=1.5, all_masked_row=True):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=gen).tolist()
    lengths[1] = t
    if all_masked_row:
        lengths[3] = 0  # a row with no trained token
    mask = [[j < n for j in range(t)] for n in lengths]
    lp = (-torch.rand(b, t, generator=gen, dtype=torch.float64) * 3 - 0.05).tolist()
    old = [[x - d for x, d in zip(row, drow)]
           for row, drow in zip(lp, (torch.randn(b, t, generator=gen, dtype=torch.float64) * scale).tolist())]
    adv = (torch.randn(b, generator=gen, dtype=torch.float64)).tolist()
    adv[0], adv[2] = -abs(adv[0]) - 0.5, -abs(adv[2]) - 0.5  # negative advantages, for the dual clip
    ref = [[x + d for x, d in zip(row, drow)]
           for row, drow in zip(lp, (torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.7).tolist())]
    ent = (torch.rand(b, t, generator=gen, dtype=torch.float64) * 2).tolist()
    return lp, old, adv, mask, ref, ent


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def ref_loss(lp, old, adv, mask, *, mode="ppo_clip", agg="token-mean", cl=0.2, ch=0.28, dual=0.0, kl_coef=0.0,
             ref=None, estimator="k3", ent_coef=0.0, ent=None, is_w=None, num_tokens=None, num_seqs=None):
    """``agg(sg(w) pg) + kl_coef agg(kl) - ent_coef agg(entropy)`` and its gradients by logp and by the entropy."""
    pg, dpg = ref_pg(lp, old, adv, mask, mode, cl, ch, dual)
    w = is_w if is_w is not None else [[1.0] * len(row) for row in lp]
    aw = _agg_weights(mask, agg, num_tokens, num_seqs)
    value = ref_aggregate([[p * x for p, x in zip(pr, wr)] for pr, wr in zip(pg, w)], mask, agg, num_tokens, num_seqs)
    g_lp = [[0.0] * len(row) for row in lp]
    for i, row in enumerate(lp):
        seq_weight = math.fsum(a * x for a, x in zip(aw[i], w[i]))  # gspo: pg_i sits on every token of i
        for t in range(len(row)):
            g_lp[i][t] = seq_weight * dpg[i][t] if mode == "gspo" else aw[i][t] * w[i][t] * dpg[i][t]
    if ref is not None:
        kl = [[ref_kl(x, r, estimator) if m else (0.0, 0.0) for x, r, m in zip(lr, rr, mr)]
              for lr, rr, mr in zip(lp, ref, mask)]
        value += kl_coef * ref_aggregate([[k[0] for k in row] for row in kl], mask, agg, num_tokens, num_seqs)
        for i, row in enumerate(kl):
            for t, (_, dk) in enumerate(row):
                g_lp[i][t] += kl_coef * aw[i][t] * dk
    g_ent = None
    if ent is not None:
        value -= ent_coef * ref_aggregate(ent, mask, agg, num_tokens, num_seqs)
        g_ent = [[-ent_coef * a for a in row] for row in aw]
    return value, g_lp, g_ent


def _run(lp, old, adv, mask, *, mode, agg, cl, ch, dual=0.0, kl_coef=0.0, ref=None, estimator="k3",
         ent_coef=0.0, ent=None, is_w=None, num_tokens=None, num_seqs=None):
    """rlrepro's policy_loss on float64 tensors; returns the loss and the gradients by logp and by the entropy."""
    logp = _t(lp).requires_grad_(True)
    entropy = _t(ent).requires_grad_(True) if ent is not None else None
    out = policy_loss(logp, _t(old), _t(adv), torch.tensor(mask), clip_low=cl, clip_high=ch, loss_agg=agg,
                      max_response_length=C_NORM, kl_coef=kl_coef, ref_logp=None if ref is None else _t(ref),
                      kl_estimator=estimator, entropy=entropy, num_tokens=num_tokens, num_seqs=num_seqs,
                      dual_clip=dual, entropy_coef=ent_coef, mode=mode, is_weight=None if is_w is None else _t(is_w))
    grads = torch.autograd.grad(out.loss, [logp] + ([entropy] if entropy is not None else []), allow_unused=True)
    return out, grads


LOSS_CASES = ([("ppo_clip", agg, 0.2, 0.28, dual) for agg in AGGS for dual in (0.0, 3.0)]
              + [("ppo_clip", "token-mean", 0.2, 0.2, 1.5)]
              + [("gspo", "seq-mean-token-mean", 0.2, 0.28, 0.0), ("gspo", "seq-mean-token-mean", 3e-4, 4e-4, 0.0)]
              + [("cispo", agg, cl, 0.28, 0.0) for agg in AGGS for cl in (0.2, 1.0)])


@pytest.mark.parametrize("mode,agg,cl,ch,dual", LOSS_CASES)
@pytest.mark.parametrize("scale", [0.05, 1.5])  # log ratios near the clip range / far outside it (ratio ~e^+-4)
def test_policy_losses_match_the_reference(mode, agg, cl, ch, dual, scale):
    """Value and autograd gradient of pg alone, then with KL (each estimator), entropy and a behaviour weight."""
    if mode == "gspo" and cl < 1e-3:
        scale = scale * 1e-3  # GSPO's per-token geometric mean ratio: the paper's clip range is ~3e-4
    lp, old, adv, mask, ref, ent = _random_batch(_seed(mode, agg, cl, dual, scale), scale=scale)
    for extra in ({}, dict(kl_coef=0.05, ref=ref, estimator="k1", ent_coef=0.01, ent=ent),
                  dict(kl_coef=0.1, ref=ref, estimator="k2"), dict(kl_coef=0.2, ref=ref, estimator="k3", ent=ent),
                  dict(is_w=[[0.5 + (i * 7 + t) % 5 * 0.3 for t in range(len(lp[0]))] for i in range(len(lp))])):
        want, want_g, want_ge = ref_loss(lp, old, adv, mask, mode=mode, agg=agg, cl=cl, ch=ch, dual=dual, **extra)
        out, grads = _run(lp, old, adv, mask, mode=mode, agg=agg, cl=cl, ch=ch, dual=dual, **extra)
        torch.testing.assert_close(out.loss, _t(want), **TOL)
        torch.testing.assert_close(grads[0], _t(want_g), **TOL)
        if want_ge is not None:
            got_ge = grads[1] if grads[1] is not None else torch.zeros_like(_t(ent))
            torch.testing.assert_close(got_ge, _t(want_ge), **TOL)
    if scale > 1:  # the far-off inputs do reach the clip bounds (and, with a dual clip, its bound); GSPO's
        # sequence means of 0.2 / 0.28 need not (its far-off sequences: test_gspo_gradient_is_the_token_variants...)
        assert out.clip_frac > 0 or (mode == "gspo" and cl > 1e-3)
        if dual:
            assert ref_loss(lp, old, adv, mask, agg=agg, cl=cl, ch=ch, dual=dual)[0] != \
                ref_loss(lp, old, adv, mask, agg=agg, cl=cl, ch=ch)[0]
    # the all-masked row (row 3) reaches nothing: no gradient at any of its positions
    assert torch.equal(grads[0][3], torch.zeros_like(grads[0][3]))


@pytest.mark.parametrize("mode,agg", [("ppo_clip", a) for a in AGGS] + [("gspo", "seq-mean-token-mean")]
                         + [("cispo", "token-mean")])
def test_micro_batch_shares_add_up_to_the_whole_batch_loss(mode, agg):
    """Gradient accumulation: each micro-batch divides by the WHOLE batch's token / sequence count, so the shares
    (values and gradients) add up to the whole-batch loss; a mean of micro-batch means would not."""
    lp, old, adv, mask, ref, ent = _random_batch(7, b=7)
    kw = dict(mode=mode, agg=agg, cl=0.2, ch=0.28, kl_coef=0.1, ref=ref, ent_coef=0.01, ent=ent)
    want, want_g, _ = ref_loss(lp, old, adv, mask, **kw)
    n, s = sum(sum(r) for r in mask), len(mask)
    total, grads, own_means = 0.0, [], []
    for a, b in ((0, 2), (2, 3), (3, 7)):
        part = [x[a:b] for x in (lp, old, adv, mask, ref, ent)]
        out, g = _run(*part[:4], **{**kw, "ref": part[4], "ent": part[5]}, num_tokens=n, num_seqs=s)
        total += float(out.loss.detach())
        grads.append(g[0])
        own_means.append(float(_run(*part[:4], **{**kw, "ref": part[4], "ent": part[5]})[0].loss.detach()))
    assert abs(total - want) <= 1e-12 * max(1.0, abs(want))
    torch.testing.assert_close(torch.cat(grads), _t(want_g), **TOL)
    assert abs(sum(own_means) / len(own_means) - want) > 1e-6  # what the global denominators avoid


def test_gspo_gradient_is_the_token_variants_with_the_stop_gradient():
    """GSPO-token (Zheng et al. 2025, eq. 13-14): s_it = sg(s_i) * pi(y_t) / sg(pi(y_t)), with A_it = A_i, has
    GSPO's value and gradient; an autograd reference of that form against rlrepro's sequence form."""
    for cl, ch, scale in ((0.2, 0.28, 0.3), (3e-4, 4e-4, 4e-4), (0.2, 0.2, 2.0)):
        lp, old, adv, mask, _, _ = _random_batch(11, scale=scale)
        logp = _t(lp).requires_grad_(True)
        m = torch.tensor(mask)
        log_ratio = torch.where(m, logp - _t(old), torch.zeros_like(logp))
        mean = (log_ratio.sum(-1) / m.sum(-1).clamp(min=1)).detach()
        s_tok = torch.exp(mean[:, None] + logp - logp.detach())
        a = _t(adv)[:, None]
        pg = torch.maximum(-a * s_tok, -a * torch.clamp(s_tok, 1 - cl, 1 + ch))
        per_seq = torch.where(m, pg, torch.zeros_like(pg)).sum(-1) / m.sum(-1).clamp(min=1)
        (want,) = torch.autograd.grad(per_seq.sum() / len(lp), logp)
        out, grads = _run(lp, old, adv, mask, mode="gspo", agg="seq-mean-token-mean", cl=cl, ch=ch)
        torch.testing.assert_close(out.loss, per_seq.sum().detach() / len(lp), **TOL)
        torch.testing.assert_close(grads[0], want, **TOL)
        assert out.clip_frac > 0 or scale < 1  # the far-off case clips some sequences


def test_cispo_gradient_is_the_clipped_weight_times_the_advantage():
    """d pg / d logp = -clip(ratio, 1 - clip_low, 1 + clip_high) * A for every token (none loses its gradient),
    the ratio itself gets none (stop-gradient); clip_low=1: no lower bound (MiniMax-M1)."""
    lp, old, adv, mask, _, _ = _random_batch(13, scale=3.0)
    n = sum(sum(r) for r in mask)
    for cl in (0.2, 1.0):
        out, grads = _run(lp, old, adv, mask, mode="cispo", agg="token-mean", cl=cl, ch=0.28)
        want = [[-_clip(math.exp(x - o), 1 - cl, 1.28) * adv[i] / n if m else 0.0
                 for x, o, m in zip(lp[i], old[i], mask[i])] for i in range(len(lp))]
        torch.testing.assert_close(grads[0], _t(want), **TOL)
        trained = torch.tensor(mask) & (_t(adv)[:, None] != 0)
        assert (grads[0][trained] != 0).all()  # clipped or not, every trained token keeps a gradient
        assert out.clip_frac > 0


def test_dual_clip_bounds_negative_advantages_only():
    """Ratios far outside the clip range: with A > 0 the dual clip changes nothing; with A < 0 the unclipped -A r
    above -A c is bounded there (no gradient); below c nothing changes."""
    lp = [[0.0, 0.0, 0.0, 0.0]] * 2
    old = [[-3.0, -0.5, 0.5, -1.5]] * 2  # ratios e^3 ~ 20.1, e^0.5, e^-0.5, e^1.5 ~ 4.5
    mask = [[True] * 4] * 2
    adv = [1.3, -0.7]
    c = 3.0
    plain, g_plain = _run(lp, old, adv, mask, mode="ppo_clip", agg="token-mean", cl=0.2, ch=0.28)
    dual, g_dual = _run(lp, old, adv, mask, mode="ppo_clip", agg="token-mean", cl=0.2, ch=0.28, dual=c)
    want, want_g, _ = ref_loss(lp, old, adv, mask, dual=c)
    torch.testing.assert_close(dual.loss, _t(want), **TOL)
    torch.testing.assert_close(g_dual[0], _t(want_g), **TOL)
    assert torch.equal(g_plain[0][0], g_dual[0][0])  # A > 0: the dual clip changes nothing
    assert float(plain.loss.detach()) > float(dual.loss.detach())
    # A < 0 (ratios e^3, e^0.5, e^-0.5, e^1.5): -A r above -A c = 2.1 for e^3 and e^1.5, which the dual clip
    # bounds (no gradient); e^0.5 stays unclipped (-A r = 1.15 < 2.1); e^-0.5 sits on 1 - clip_low either way
    assert [v != 0.0 for v in g_plain[0][1].tolist()] == [True, True, False, True]
    assert [v != 0.0 for v in g_dual[0][1].tolist()] == [False, True, False, False]
    assert (plain.clip_frac, dual.clip_frac) == (4 / 8, 6 / 8)


# ------------------------------------------------------------------------------------------------------- KL terms
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_values_gradients_and_direction(estimator):
    """Per token against Schulman 2020 (r = pi_ref / pi); then exactly in expectation over a categorical pi (the
    samples' distribution held fixed, as in a loss): E[k1] = E[k3] = KL(pi || pi_ref); the expected gradient is
    0 for k1, that of KL(pi || pi_ref) for k2 and that of the reverse KL(pi_ref || pi) for k3 (docs/TRAINER.md)."""
    gen = torch.Generator().manual_seed(5)
    lp = (-torch.rand(4, 6, generator=gen, dtype=torch.float64) * 4).tolist()
    ref = [[x + d for x, d in zip(r, dr)] for r, dr in zip(lp, (torch.randn(4, 6, generator=gen,
                                                                             dtype=torch.float64) * 2).tolist())]
    logp = _t(lp).requires_grad_(True)
    got = kl_penalty(logp, _t(ref), estimator)
    (grad,) = torch.autograd.grad(got.sum(), logp)
    want = [[ref_kl(x, r, estimator) for x, r in zip(lr, rr)] for lr, rr in zip(lp, ref)]
    torch.testing.assert_close(got, _t([[v for v, _ in row] for row in want]), **TOL)
    torch.testing.assert_close(grad, _t([[g for _, g in row] for row in want]), **TOL)
    if estimator == "k3":
        assert (got >= 0).all()
    # the expectation over a categorical policy pi = softmax(theta), reference pi_ref
    theta = torch.randn(7, generator=gen, dtype=torch.float64, requires_grad=True)
    log_ref = torch.log_softmax(torch.randn(7, generator=gen, dtype=torch.float64), 0)
    log_pi = torch.log_softmax(theta, 0)
    pi = log_pi.exp().detach()
    expected = (pi * kl_penalty(log_pi, log_ref, estimator)).sum()
    (g_est,) = torch.autograd.grad(expected, theta, retain_graph=True)
    forward = (log_pi.exp() * (log_pi - log_ref)).sum()  # KL(pi || pi_ref)
    reverse = (log_ref.exp() * (log_ref - log_pi)).sum()  # KL(pi_ref || pi)
    if estimator != "k2":  # (k2 is biased)
        torch.testing.assert_close(expected.detach(), forward.detach(), **TOL)
    want_g = {"k1": lambda: torch.zeros(7, dtype=torch.float64), "k2": lambda: torch.autograd.grad(forward, theta)[0],
              "k3": lambda: torch.autograd.grad(reverse, theta)[0]}[estimator]()
    torch.testing.assert_close(g_est, want_g, **TOL)


def test_the_kl_is_a_loss_term_only_not_in_the_reward():
    """With kl_coef > 0 the advantages are untouched (compute_advantages takes no KL) and the loss is
    agg(pg) + kl_coef * agg(kl); kl_coef = 0 with ref_logp reports the KL and leaves the loss unchanged."""
    lp, old, adv, mask, ref, _ = _random_batch(17)
    base, _ = _run(lp, old, adv, mask, mode="ppo_clip", agg="token-mean", cl=0.2, ch=0.28)
    reported, _ = _run(lp, old, adv, mask, mode="ppo_clip", agg="token-mean", cl=0.2, ch=0.28, ref=ref)
    assert torch.equal(base.loss, reported.loss) and reported.kl > 0 and base.kl == 0.0
    kl = [[ref_kl(x, r, "k3")[0] for x, r in zip(lr, rr)] for lr, rr in zip(lp, ref)]
    # (the reported metric is a float32 token mean)
    torch.testing.assert_close(_t(reported.kl), _t(ref_aggregate(kl, mask, "token-mean")), rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------- behaviour weights (TIS/MIS)
def ref_behaviour(prox, beh, mask, correction, cap=2.0, low=0.5, high=2.0):
    """Decoupled PPO's detached weight (Hilton et al. 2021; AReaL): rho_t = pi_prox / mu per token; tis: min(rho_t,
    cap) (Ionides 2008; Yao et al. 2025); mis: the sequence ratio prod_t rho_t, 0 outside [low, high] (Seq-MIS);
    1 outside the mask. Also the truncated / masked flags and k3 of KL(mu || pi_prox) per token."""
    weight, truncated, masked, kl = [], [], [], []
    for pr, br, mr in zip(prox, beh, mask):
        rho = [math.exp(p - b) if m else 1.0 for p, b, m in zip(pr, br, mr)]
        log_seq = math.fsum(p - b for p, b, m in zip(pr, br, mr) if m)
        keep = (low == 0 or log_seq >= math.log(low)) and log_seq <= math.log(high)
        if correction == "none":
            w = rho
        elif correction == "tis":
            w = [min(r, cap) if m else 1.0 for r, m in zip(rho, mr)]
        else:
            w = [(math.exp(log_seq) if keep else 0.0) if m else 1.0 for m in mr]
        weight.append(w)
        truncated.append([correction == "tis" and m and r > cap for r, m in zip(rho, mr)])
        masked.append([correction == "mis" and m and not keep for m in mr])
        kl.append([(r - 1 - (p - b)) if m else 0.0 for r, p, b, m in zip(rho, pr, br, mr)])
    return weight, truncated, masked, kl


@pytest.mark.parametrize("correction,kw", [("none", {}), ("tis", dict(is_cap=2.0)), ("tis", dict(is_cap=1.2)),
                                           ("mis", dict(mis_low=0.5, mis_high=2.0)),
                                           ("mis", dict(mis_low=0.0, mis_high=1.5)),
                                           ("mis", dict(mis_low=0.25, mis_high=4.0))])
def test_behaviour_weights_match_the_reference(correction, kw):
    lp, old, _, mask, _, _ = _random_batch(23, b=8, scale=0.8)
    got = behaviour_weights(_t(lp), _t(old), torch.tensor(mask), correction=correction, **kw)
    cap, low, high = kw.get("is_cap", 2.0), kw.get("mis_low", 0.5), kw.get("mis_high", 2.0)
    w, truncated, masked, kl = ref_behaviour(lp, old, mask, correction, cap, low, high)
    torch.testing.assert_close(got.weight, _t(w), **TOL)
    torch.testing.assert_close(got.kl, _t(kl), **TOL)
    assert got.truncated.tolist() == truncated and got.masked.tolist() == masked
    if correction == "tis":
        assert any(map(any, truncated))  # some tokens reach the cap
    if correction == "mis":
        kept = [not any(row) for row, m in zip(masked, mask) if any(m)]
        assert any(kept) and not all(kept)  # some sequences kept, some masked


def test_the_decoupled_loss_matches_the_reference():
    """agg(sg(w) * pg(ratio to the proximal policy)) with the TIS weight of the behaviour policy, end to end."""
    lp, prox, adv, mask, _, _ = _random_batch(29, scale=0.4)
    beh = [[p - d for p, d in zip(row, drow)] for row, drow in
           zip(prox, (torch.randn(len(lp), len(lp[0]), generator=torch.Generator().manual_seed(3),
                                  dtype=torch.float64) * 0.6).tolist())]
    w = behaviour_weights(_t(prox), _t(beh), torch.tensor(mask), correction="tis", is_cap=1.5).weight
    for mode, agg in (("ppo_clip", "token-mean"), ("gspo", "seq-mean-token-mean"), ("cispo", "token-mean")):
        want, want_g, _ = ref_loss(lp, prox, adv, mask, mode=mode, agg=agg,
                                   is_w=ref_behaviour(prox, beh, mask, "tis", cap=1.5)[0])
        out, grads = _run(lp, prox, adv, mask, mode=mode, agg=agg, cl=0.2, ch=0.28, is_w=w.tolist())
        torch.testing.assert_close(out.loss, _t(want), **TOL)
        torch.testing.assert_close(grads[0], _t(want_g), **TOL)


# ---------------------------------------------------------------------------------------------- overlong shaping
@pytest.mark.parametrize("max_tokens,buffer,factor", [(20, 6, 1.0), (20, 6, 0.5), (16, 1, 1.0), (4096, 1024, 1.0)])
def test_overlong_penalty_is_daposs_soft_punishment(max_tokens, buffer, factor):
    """DAPO eq. 13 with L_max = rollout.max_tokens, L_cache = reward.overlong_buffer: 0 up to L_max - L_cache,
    ((L_max - L_cache) - |y|) / L_cache (times the factor) up to L_max, -1 (times the factor) beyond."""
    def ref(n):
        if n <= max_tokens - buffer:
            return 0.0
        if n <= max_tokens:
            return factor * ((max_tokens - buffer) - n) / buffer
        return -factor
    for n in list(range(0, 40)) + [max_tokens - buffer, max_tokens - buffer + 1, max_tokens - 1, max_tokens,
                                   max_tokens + 1, 10 * max_tokens]:
        assert abs(overlong_penalty(n, max_tokens, buffer, factor) - ref(n)) <= 1e-15, n
    assert overlong_penalty(max_tokens, max_tokens, buffer, factor) == -factor
    assert overlong_penalty(max_tokens - buffer, max_tokens, buffer, factor) == 0.0


# ----------------------------------------------------------------------------------- aggregate (the function alone)
@pytest.mark.parametrize("agg", AGGS)
def test_aggregate_matches_the_reference_with_an_all_masked_row(agg):
    lp, _, _, mask, _, _ = _random_batch(31)
    got = aggregate(_t(lp), torch.tensor(mask), agg, max_response_length=C_NORM)
    torch.testing.assert_close(got, _t(ref_aggregate(lp, mask, agg)), **TOL)
    none = [[False] * len(lp[0]) for _ in lp]  # nothing trained: 0, not NaN
    assert float(aggregate(_t(lp), torch.tensor(none), agg, max_response_length=C_NORM)) == 0.0


def test_the_log_ratio_bound_is_the_documented_one():
    """A documented choice (verl's too): the log ratio is clamped to +-20 before exp, so beyond it the ratio is
    e^+-20 (PPO: the token is clipped, no gradient; CISPO without a lower bound: weight e^-20, not e^-25)."""
    lp, old, mask = [[-1.0, -1.0]], [[-26.0, 24.0]], [[True, True]]  # log ratios +25 and -25
    out, grads = _run(lp, old, [1.0], mask, mode="cispo", agg="token-mean", cl=1.0, ch=0.28)
    assert grads[0].tolist()[0] == [-1.28 / 2, -math.exp(-20.0) / 2]
    out, grads = _run(lp, old, [-1.0], mask, mode="ppo_clip", agg="token-mean", cl=0.2, ch=0.28)
    torch.testing.assert_close(out.loss, _t((math.exp(20.0) + 0.8) / 2), **TOL)
    # e^20 is unclipped under A < 0 but the clamp passes no gradient beyond the bound; e^-20 sits on 1 - clip_low
    assert grads[0].tolist()[0] == [0.0, 0.0]

"""Probes between ``gluon_attention_fwd.probe_tma_wait`` (one TMA load, a wait, a copy: it runs) and the Gluon
attention forward (it hangs on Hopper; issue #27): one kernel with switches that add the forward's pieces one at a
time, so that the first switch that hangs names the piece. Run by ``bench_attention_gluon.py --probes``.

The consumer is the default partition (``num_warps`` warps, ``16 * num_warps`` rows for wgmma), the producer a
worker of ``PW`` warps with ``PREGS`` registers (as the forward's ``GLW_VARIANT=one``). Switches:

- ``TWO``: K and V tiles, each on its own "ready" barrier (the consumer waits on both);
- ``QSTORE``: before waiting, the consumer stores a Q tile from global memory into shared memory, fences and
  syncs its warps (the forward's prologue);
- ``MMA``: after the wait, ``Q @ K^T`` on the tensor cores (needs ``QSTORE``) is written out instead of K itself.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROWS_KV = 64


@gluon.jit
def _load(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, TWO: gl.constexpr):
    row = (gl.program_id(0) * k_desc.block_type.shape[0]).to(gl.int32)
    mbarrier.expect(k_ready.index(0), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, 0], k_ready.index(0), k_bufs.index(0))
    if TWO:
        mbarrier.expect(v_ready.index(0), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, 0], v_ready.index(0), v_bufs.index(0))


@gluon.jit
def _use(q_ptr, out_ptr, q_smem, k_bufs, v_bufs, k_ready, v_ready, NR: gl.constexpr, BKV: gl.constexpr,
         D: gl.constexpr, NW: gl.constexpr, TWO: gl.constexpr, QSTORE: gl.constexpr, MMA: gl.constexpr):
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [NW, 1], [1, 0])
    pid = gl.program_id(0)
    if QSTORE:
        r = gl.arange(0, NR, layout=gl.SliceLayout(1, ld))
        c = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        q = gl.load(q_ptr + (pid * NR + r).to(gl.int64)[:, None] * D + c[None, :])
        q_smem.store(q)
        fence_async_shared()
        gl.thread_barrier()
    mbarrier.wait(k_ready.index(0), 0)
    if TWO:
        mbarrier.wait(v_ready.index(0), 0)
    if MMA:
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                        instr_shape=[16, BKV, 16])
        acc = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), gl.zeros([NR, BKV], gl.float32, acc_l),
                            use_acc=False)
        ro = gl.arange(0, NR, layout=gl.SliceLayout(1, acc_l))
        co = gl.arange(0, BKV, layout=gl.SliceLayout(0, acc_l))
        gl.store(out_ptr + (pid * NR + ro).to(gl.int64)[:, None] * BKV + co[None, :], acc)
    else:
        tile = k_bufs.index(0).load(ld)
        rk = gl.arange(0, BKV, layout=gl.SliceLayout(1, ld))
        ck = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        gl.store(out_ptr + (pid * BKV + rk).to(gl.int64)[:, None] * D + ck[None, :], tile.to(gl.float32))


@gluon.jit
def _probe2_kernel(q_ptr, k_desc, v_desc, out_ptr, q_layout: gl.constexpr, NR: gl.constexpr, TWO: gl.constexpr,
                   QSTORE: gl.constexpr, MMA: gl.constexpr, PW: gl.constexpr, PREGS: gl.constexpr):
    BKV: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = k_desc.block_type.shape[1]
    q_smem = gl.allocate_shared_memory(k_desc.dtype, [NR, D], q_layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [1, BKV, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [1, BKV, D], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(k_ready.index(0), count=1)
    mbarrier.init(v_ready.index(0), count=1)
    gl.warp_specialize([
        (_use, (q_ptr, out_ptr, q_smem, k_bufs, v_bufs, k_ready, v_ready, NR, BKV, D, gl.num_warps(), TWO, QSTORE,
                MMA)),
        (_load, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, TWO)),
    ], [PW], [PREGS])


def probe(programs: int, *, num_warps: int = 4, two: bool = False, qstore: bool = False, mma: bool = False,
          pw: int = 1, pregs: int = 24, maxnreg: int = 0) -> tuple[bool, float]:
    """Run ``_probe2_kernel`` on ``programs`` tiles; (the output equals the torch reference, its max error)."""
    d = 128
    nr = 16 * num_warps
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(programs * ROWS_KV, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(programs * ROWS_KV, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(programs * nr, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    lay = gl.NVMMASharedLayout.get_default_for([ROWS_KV, d], gl.bfloat16)
    kd = TensorDescriptor(k, list(k.shape), [k.stride(0), 1], [ROWS_KV, d], lay)
    vd = TensorDescriptor(v, list(v.shape), [v.stride(0), 1], [ROWS_KV, d], lay)
    if mma:
        out = torch.empty(programs * nr, ROWS_KV, device="cuda", dtype=torch.float32)
        want = torch.cat([q[i * nr:(i + 1) * nr].float() @ k[i * ROWS_KV:(i + 1) * ROWS_KV].float().T
                          for i in range(programs)])
    else:
        out = torch.empty(programs * ROWS_KV, d, device="cuda", dtype=torch.float32)
        want = k.float()
    opts = dict(num_warps=num_warps)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    _probe2_kernel[(programs,)](q, kd, vd, out, gl.NVMMASharedLayout.get_default_for([nr, d], gl.bfloat16), nr,
                                two, qstore or mma, mma, pw, pregs, **opts)
    torch.cuda.synchronize()
    err = (out - want).abs().max().item()
    return err < (1e-2 if mma else 1e-6), err


#: name -> probe kwargs, in the order they add the forward's pieces (the last is the forward's layout, "one")
CASES = {
    "base": {},
    "two-barriers": dict(two=True),
    "q-store": dict(qstore=True),
    "q-store+mma": dict(mma=True),
    "all": dict(two=True, mma=True),
    "all, 4-warp producer": dict(two=True, mma=True, pw=4),
    "all, 8 warps, 4-warp producer, maxnreg 168": dict(two=True, mma=True, pw=4, num_warps=8, maxnreg=168),
}


@gluon.jit
def _probe_load(desc, bufs, ready):
    """The minimal producer: one TMA load of the tile at row 64 * program into ``bufs``, on ``ready``."""
    row = (gl.program_id(0) * desc.block_type.shape[0]).to(gl.int32)
    mbarrier.expect(ready.index(0), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, 0], ready.index(0), bufs.index(0))

@gluon.jit
def _probe_copy(out_ptr, bufs, ready, ROWS_: gl.constexpr, COLS: gl.constexpr, NW_: gl.constexpr):
    """The minimal consumer: wait for the tile, copy it from shared memory to ``out``."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // COLS, COLS // 8], [NW_, 1], [1, 0])
    mbarrier.wait(ready.index(0), 0)
    tile = bufs.index(0).load(layout)
    r = gl.program_id(0) * ROWS_ + gl.arange(0, ROWS_, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    gl.store(out_ptr + r.to(gl.int64)[:, None] * COLS + c[None, :], tile)

@gluon.jit
def _probe_kernel(desc, out_ptr, PRODUCER_DEFAULT: gl.constexpr):
    """Issue #27's hang, reduced: one partition loads one [64, COLS] tile by TMA, another waits on its barrier
    and copies the tile out. ``PRODUCER_DEFAULT``: the producer is the default partition (else a worker)."""
    ROWS_: gl.constexpr = desc.block_type.shape[0]
    COLS: gl.constexpr = desc.block_type.shape[1]
    bufs = gl.allocate_shared_memory(desc.dtype, [1, ROWS_, COLS], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(ready.index(0), count=1)
    if PRODUCER_DEFAULT:
        gl.warp_specialize([(_probe_load, (desc, bufs, ready)),
                            (_probe_copy, (out_ptr, bufs, ready, ROWS_, COLS, 4))], [4], [120])
    else:
        gl.warp_specialize([(_probe_copy, (out_ptr, bufs, ready, ROWS_, COLS, 4)),
                            (_probe_load, (desc, bufs, ready))], [1], [24])


def probe_tma_wait(x: torch.Tensor, producer_default: bool) -> torch.Tensor:
    """The reduced hang (``_probe_kernel``) on a [64 * programs, 128] 16-bit tensor: returns the copy, which must
    equal ``x`` (``benchmarks/bench_attention_gluon.py --minimal``)."""
    rows, cols = 64, x.shape[1]
    dt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    desc = TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [rows, cols],
                            gl.NVMMASharedLayout.get_default_for([rows, cols], dt))
    out = torch.empty_like(x)
    _probe_kernel[(x.shape[0] // rows,)](desc, out, producer_default, num_warps=4)
    return out

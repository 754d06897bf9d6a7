#!/usr/bin/env bash
# gpu_check.sh — everything that needs the GPU machine, in one go: a list of steps, each logging to
# $OUT/<name>.log, each run even when an earlier one failed, and a summary table printed last.
#
#   scripts/gpu_check.sh                 # all steps
#   scripts/gpu_check.sh gpu_tests       # only the named steps
#   BENCH_ARGS=--sweep scripts/gpu_check.sh bench_kernels
#   GPU_CHECK_MAX_S=240 scripts/gpu_check.sh grpo_two  # cap every step's timeout (a short device budget)
#   # two GPUs, two things at once (each with its own OUT):
#   CUDA_VISIBLE_DEVICES=0 OUT=$OUT/gpu0 scripts/gpu_check.sh grpo & CUDA_VISIBLE_DEVICES=1 OUT=$OUT/gpu1 \
#     scripts/gpu_check.sh bench_engine; wait
#
# On the device machine (run from the repo root): `OUT` is set by the tool; elsewhere it defaults to
# ./gpu_check_out. rlrepro is not installed there: the repo root goes on PYTHONPATH. To add a step, write one
# `add_step NAME TIMEOUT_S 'command'` line below; keep names to letters, digits, '_' and '-'.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
# Everything is written under a scratch folder, then packed into $OUT/results.tgz beside $OUT/summary.txt: the
# device tool brings back at most 8 files, 2 folders down, so loose files would be lost.
FINAL_OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$FINAL_OUT"
OUT=$(mktemp -d /tmp/gpu_check.XXXXXX)
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

# the GPU machine has no ray/hydra/datasets of its own: the package kit (.devkit, carried) installs them
kit() { $PY -c "import ray, hydra, datasets" 2>/dev/null || source .devkit/install.sh; }
export -f kit
# flashinfer (the fast mode's attention, issue #27) travels as wheels in .fi/ (scripts/make_fi_kit.sh; carried):
# flashinfer-python 0.5.3, apache-tvm-ffi 0.1.x, nvidia-cudnn-frontend, installed without their dependencies
fi_kit() {
  $PY -c "import flashinfer" 2>/dev/null && return 0
  [ -d .fi ] || { echo "no .fi/ wheels: flashinfer steps run without flashinfer"; return 0; }
  [ -f /tmp/fi/.ok ] || { $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/fi .fi/*.whl && touch /tmp/fi/.ok; }
  export PYTHONPATH=/tmp/fi:$PYTHONPATH
}
export -f fi_kit

STEP_NAMES=()
STEP_TIMEOUTS=()
STEP_CMDS=()
add_step() { STEP_NAMES+=("$1"); STEP_TIMEOUTS+=("$2"); STEP_CMDS+=("$3"); }

# ---------------------------------------------------------------------------------------------- steps
add_step env 60 '
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  $PY -c "import sys, torch, triton; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0)); print(\"triton\", triton.__version__)"
  $PY -m pytest --version'
add_step gpu_tests 300 'kit && $PY -m pytest -m gpu -q -p no:cacheprovider ${GPU_TEST_PATHS:-tests/}'
# the same tests, a pytest process per test function (or per 5 of its parameter sets: GPU_TEST_SPLIT), 8 at once
# (compiling is most of their time, on the CPU): the whole GPU suite within one device call; a log per process under
# gpu_tests_par/
# (its budget ends 30 s before the step's own deadline, which GPU_CHECK_MAX_S may bring forward, so the summary is
# always printed; GPU_TEST_BUDGET may shorten it further)
add_step gpu_tests_par 560 'kit && fi_kit && budget=$(( STEP_DEADLINE - $(date +%s) - 30 )) && { [ -z "${GPU_TEST_BUDGET:-}" ] || [ "$GPU_TEST_BUDGET" -ge "$budget" ] || budget=$GPU_TEST_BUDGET; } && $PY scripts/gpu_tests_parallel.py --jobs ${GPU_TEST_JOBS:-8} --budget $budget --split ${GPU_TEST_SPLIT:-5} --out "$OUT/gpu_tests_par" ${GPU_TEST_PATHS:-tests/}'
# the fast mode's flashinfer paths and long-context attention (issue #27); flashinfer JIT-compiles on first use
add_step fast_tests 420 'kit && fi_kit && $PY -m pytest -m gpu -q -p no:cacheprovider ${FAST_TEST_PATHS:-tests/test_attention_gpu_long.py}'
# the attention backward's tile configs against SDPA's flash backward (issue #27)
add_step attention_bwd 300 '$PY benchmarks/bench_attention_bwd.py --out "$OUT/attention_bwd.md" ${ATTN_BWD_ARGS:-}'
# the forward's tile variants (rows, warps, stages, TMA or pointer loads, -nR: a register cap): speed and each one's
# bit promises (ATTN_FWD_ARGS="--variants kv64,kv64-r256w16-s3,kv64-n128")
add_step attention_fwd 540 'fi_kit && $PY benchmarks/bench_attention_fwd.py --out "$OUT/attention_fwd.md" ${ATTN_FWD_ARGS:-}'
# the EXPERIMENTAL warp-specialised Gluon forward (rlrepro/kernels/gluon_attention_fwd.py; it hung on the H100, so
# the script runs it in a child with a time limit): bits against the Triton forward's, then speed beside the Triton
# "long" tile, FA3 and SDPA (issue #27; GLUON_ARGS="--stages 3 --no-bits --timeout 60", or "--minimal-only" for the
# reduced TMA-wait case alone; the GLW_* variables pass on)
add_step attention_gluon 540 'fi_kit && $PY benchmarks/bench_attention_gluon.py --out "$OUT/attention_gluon.md" ${GLUON_ARGS:-}'
# the Gluon forward as the "long" tile's kernel on sm_90 (triton_attention_fwd.use_gluon): its GPU tests and the
# attention GPU tests it now serves, then a 2-layer 8B-width train step of 8 x 8k tokens without and with it (twice)
add_step gluon_fwd 540 'kit && $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_gluon_forward.py tests/test_attention_gpu_long.py tests/test_triton_kernels.py && for g in 0 1 0 1; do RLREPRO_ATTENTION_GLUON=$g $PY benchmarks/bench_trainer.py --qwen3-8b-shape --layers 2 --mode deterministic --num-samples 8 --prompt-len 1024 --completion-len 7168 --micro-batch-size 1 --logits-chunk-size 4096 --warmup 1 --steps 2 --no-phases --json "$OUT/train_gluon_${g}_$RANDOM.json" || exit 1; done'
# where the forward's time goes (issue #27): Nsight Compute on one launch of each kernel at PROFILE_SHAPE (4x2048),
# the Gluon kernel in each PROFILE_ORDERS order against FlashAttention-3, if ncu is on the machine
add_step profile_fwd 420 'fi_kit && NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); if [ -z "$NCU" ]; then echo "no ncu on this machine"; ls /usr/local/cuda/bin 2>/dev/null | tr "\n" " "; exit 0; fi; echo "ncu: $NCU"; $NCU --version | tail -1; ST=$(for r in barrier long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle membar sleeping dispatch_stall no_instruction selected not_selected lg_throttle branch_resolving misc; do printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," $r; done); for spec in ${PROFILE_SPECS:-gluon:64 gluon:128f fa3:64}; do k=${spec%%:*}; o=${spec#*:}; f="$OUT/ncu_${k}_$o"; export RLREPRO_ATTENTION_ORDER=$o GLW_PP=$([ $o = 128f ] && echo 1 || echo 0); if [ $k = gluon ]; then KF="--kernel-name regex:attn_fwd_ws --launch-count 1"; else KF="--launch-count 6"; fi; run() { timeout 150 $NCU $KF "$@" $PY benchmarks/profile_attention_fwd.py --shape ${PROFILE_SHAPE:-4x2048} --kernels $k --iters 1; }; run --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy > "$f.txt" 2>&1; echo "$spec sections: rc $?"; grep -E "Context|Duration|Compute \(SM\) Throughput|Memory Throughput|Warp Cycles Per Issued|Issued Ipc|No Eligible|One or More|Registers Per|Achieved Occupancy|Executed Ipc|ERROR" "$f.txt" | head -60; run --metrics "${ST%,}" > "${f}_stalls.txt" 2>&1; echo "$spec stalls: rc $?"; grep -E "Context|stalled|ERROR" "${f}_stalls.txt" | head -80; done'
# issue #27's second reduction order (RLREPRO_ATTENTION_ORDER=128f): its GPU tests (every tile, the battery, the Gluon
# kernel's bits in both orders, engine == trainer at 8k), then a 2-layer 8B-width train step of 8 x 8k tokens in each
# order, twice, alternating
add_step order_128f 560 'kit && $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_attention_order.py tests/test_gluon_forward.py && for o in 64 128f 64 128f; do RLREPRO_ATTENTION_ORDER=$o $PY benchmarks/bench_trainer.py --qwen3-8b-shape --layers 2 --mode deterministic --num-samples 8 --prompt-len 1024 --completion-len 7168 --micro-batch-size 1 --logits-chunk-size 4096 --warmup 1 --steps 2 --no-phases --json "$OUT/train_order_${o}_$RANDOM.json" || exit 1; done'
# the engine (36 layers, 64 requests, 512/512 unless ORDER_ENGINE_ARGS says otherwise, deterministic) in each order
add_step order_engine 560 'for o in ${ORDER_LIST:-64 128f}; do RLREPRO_ATTENTION_ORDER=$o $PY benchmarks/bench_engine.py --qwen3-8b-shape --num-requests 64 --modes deterministic --no-hf ${ORDER_ENGINE_ARGS:-} --json "$OUT/engine_order_$o.json" || exit 1; done'
# the engine with and without the 256-row attention tile: prefill time, and the outputs' bits equal (8 layers)
add_step engine_tiles 300 '$PY benchmarks/bench_engine_tiles.py --json "$OUT/engine_tiles.json" ${ENGINE_TILES_ARGS:-}'
# is flashinfer's FA3 forward batch-, chunk- and decode-invariant (the bits), and how fast are its paged forms?
# (issue #27: one kernel for the trainer, prefill and decode at FA3 speed, if the bits hold; JIT-compiles ~4 kernels)
add_step fa3_invariance 540 'fi_kit && $PY benchmarks/probe_fa3_invariance.py --out "$OUT/fa3_invariance.md" ${FA3_PROBE_ARGS:-}'
# other tiles of the FA3 kernel (rlrepro/kernels/fa3_variants.py): the paged kernel's bits from the TMA kernel with
# 96-position KV tiles and from a 64-row decode kernel? and their speed (issue #27; .fa3pre/ may carry variants
# compiled elsewhere, else each JIT-compiles here)
add_step fa3_tiles 560 'fi_kit && RLREPRO_FA3_PREBUILT=$ROOT/.fa3pre $PY benchmarks/probe_fa3_tiles.py --out "$OUT/fa3_tiles.md" ${FA3_TILES_ARGS:-}'
# a Triton decode in FA3's order (rlrepro/kernels/triton_fa3_decode.py): FA3's bits for every decode row of the
# battery (each arithmetic switch, each launch shape), then its speed beside FA3's folded decode and rlrepro's own
add_step fa3_decode 420 'fi_kit && $PY benchmarks/probe_fa3_decode.py --out "$OUT/fa3_decode.md" ${FA3_DECODE_ARGS:-}'
# the FA3 experiment through rlrepro (RLREPRO_ATTENTION=fa3): its GPU tests (invariance battery, engine ==
# trainer at 8k on CUDA graphs, the Triton backward from FA3's lse) and the FA2 backward's (RLREPRO_ATTENTION_BWD=
# flash2), then the engine with the Triton attention (triton) and with FA3, in one call
add_step fa3_tests 420 'kit && fi_kit && $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_fa3_attention.py tests/test_fa3_decode.py tests/test_flash2_bwd.py'
add_step engine_fa3 500 'fi_kit && for a in ${FA3_ORDER:-triton fa3}; do RLREPRO_ATTENTION=$a $PY benchmarks/bench_engine.py --qwen3-8b-shape --num-requests ${FA3_REQUESTS:-64} --modes deterministic --no-hf --json "$OUT/engine_fa3_$a.json" || exit 1; done'
# the 16k train step with each forward:backward pair of ATTN_COMBOS (RLREPRO_ATTENTION : RLREPRO_ATTENTION_BWD)
add_step train_long_attn 590 'kit && fi_kit && for c in ${ATTN_COMBOS:-triton:triton fa3:triton fa3:flash2}; do RLREPRO_ATTENTION=${c%%:*} RLREPRO_ATTENTION_BWD=${c##*:} $PY benchmarks/bench_trainer.py --qwen3-8b-shape --layers 2 --mode deterministic --num-samples 16 --prompt-len 1024 --completion-len 15360 --micro-batch-size 1 --logits-chunk-size 4096 --warmup 1 --steps 2 --no-phases --json "$OUT/train_long_${c%%:*}_${c##*:}.json" || exit 1; done'
# torch's attention backward kernels (FA2 varlen deterministic or not, SDPA's backends) vs the Triton backward
add_step attention_bwd_refs 400 '$PY benchmarks/bench_attention_bwd_refs.py --out "$OUT/attention_bwd_refs.md" ${ATTN_BWD_REFS_ARGS:-}'
add_step attention_long 500 'fi_kit && $PY benchmarks/bench_attention_long.py --out "$OUT/attention_long.md" ${ATTN_BENCH_ARGS:-}'
# one train step of 16 x 16k-token sequences at the 8B width (2 layers), deterministic then fast (MFU, issue #27)
add_step train_long 400 'kit && fi_kit && for m in deterministic fast; do $PY benchmarks/bench_trainer.py --qwen3-8b-shape --layers 2 --mode $m --num-samples 16 --prompt-len 1024 --completion-len 15360 --micro-batch-size 1 --logits-chunk-size 4096 --warmup 1 --steps 2 --no-phases --json "$OUT/train_long_$m.json" || exit 1; done'
# the trainer's fused token logprob + entropy + gradient: its GPU bit tests, then torch ops vs fused on one
# [4096, 151936] chunk (speed, bits), then the train_long step with RLREPRO_FUSED_LOGPROB=0 and 1 (deterministic)
add_step token_logprob 300 'kit && $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_token_logprob_fused.py ; $PY benchmarks/bench_token_logprob.py --out "$OUT/token_logprob.md"'
# the same step once more under torch.profiler (deterministic): where the time goes now (top kernels)
add_step train_long_profile 300 'kit && $PY benchmarks/bench_trainer.py --qwen3-8b-shape --layers 2 --mode deterministic --num-samples 16 --prompt-len 1024 --completion-len 15360 --micro-batch-size 1 --logits-chunk-size 4096 --warmup 1 --steps 1 --profile --profile-rows 45 --json "$OUT/train_long_profile.json"'
add_step train_long_fused 500 'kit && for f in 0 1; do RLREPRO_FUSED_LOGPROB=$f $PY benchmarks/bench_trainer.py --qwen3-8b-shape --layers 2 --mode deterministic --num-samples 16 --prompt-len 1024 --completion-len 15360 --micro-batch-size 1 --logits-chunk-size 4096 --warmup 1 --steps 2 --no-phases --json "$OUT/train_long_fused$f.json" || exit 1; done'
# the engine end to end, deterministic vs fast (flashinfer attention + cuBLAS), 36 layers, 64 requests
add_step engine_fast 400 'fi_kit && $PY benchmarks/bench_engine.py --qwen3-8b-shape --num-requests 64 --no-hf ${ENGINE_BENCH_ARGS:-} --json "$OUT/engine_fast.json"'
# the experimental 128-wide K tile matmul configs: their bits against the shipped 64-wide tile, then their speed in
# the sweep (`*` marks a config whose output differs)
# (K128_MS="128,256": the sweep at those M instead of 1, 64, 1024, 4096)
add_step matmul_k128 420 'kit && $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_kernels.py -k "k128 or all_configs_agree" ; $PY benchmarks/bench_kernels.py --only matmul --sweep --k128 --ms ${K128_MS:-1,64,1024,4096} --out "$OUT/matmul_k128.md"'
# the engine (36 layers, 64 requests, 512/512, deterministic) with the small-M matmul's 64-wide K tile, then the
# 128-wide one it takes now (RLREPRO_MATMUL_K128=0, 1: the same bits, so the outputs' digest must agree)
# (K128_REQUESTS="64 256" K128_ORDER="1 0": other request counts and the other order)
add_step engine_k128 400 'for n in ${K128_REQUESTS:-64}; do for k in ${K128_ORDER:-0 1}; do RLREPRO_MATMUL_K128=$k $PY benchmarks/bench_engine.py --qwen3-8b-shape --num-requests $n --modes deterministic --no-hf --json "$OUT/engine_k128_${n}_$k.json" || exit 1; done; done'
# the issue #27 long-output workload: 64 requests of 1k prompt + 8k output tokens, 36 layers, deterministic vs fast
# (~87 GB of KV; a 64-token warm-up captures the same graphs)
add_step engine_long 590 'fi_kit && $PY benchmarks/bench_engine.py --qwen3-8b-shape --num-requests 64 --prompt-len 1024 --output-len 8192 --warmup-output-len 64 --no-hf ${ENGINE_BENCH_ARGS:-} --json "$OUT/engine_long.json"'
# train.layout_invariant (issue #26): off vs on (the fold) vs on + 8 TP pieces at the 8B width, DP=1; then DP=2 over
# 2 GPUs (nvidia-h200-x2; torchrun, NCCL); the pieces' cost in the engine (64 requests, 36 layers, P=1 vs P=8)
LAYOUT_ARGS="--hidden 4096 --layers 2 --heads 32 --kv-heads 8 --head-dim 128 --intermediate 12288 --vocab 151936 --num-samples 64 --micro-batch-size 8 --tp-partials 8 --warmup 1 --steps 3"
add_step layout_invariance 400 "\$PY benchmarks/bench_layout_invariance.py --device cuda $LAYOUT_ARGS \${LAYOUT_BENCH_ARGS:-}"
# the same at the recipe's sequence shape (1k prompt + 2k completion tokens, micro-batches of 4: 12k tokens each)
LAYOUT_LONG_ARGS="--hidden 4096 --layers 2 --heads 32 --kv-heads 8 --head-dim 128 --intermediate 12288 --vocab 151936 --num-samples 16 --prompt-len 1024 --completion-len 2048 --micro-batch-size 4 --tp-partials 8 --warmup 1 --steps 2"
add_step layout_invariance_long 400 "\$PY benchmarks/bench_layout_invariance.py --device cuda $LAYOUT_LONG_ARGS \${LAYOUT_BENCH_ARGS:-}"
# train.micro_batch_tokens (the token budget, #26's composition rule) against fixed micro-batches on a reasoning-like
# batch (64 samples, 512-token prompts, completions of 64..3072 tokens): step time and peak memory, in one call
add_step micro_batch_tokens 400 'for v in "--micro-batch-size 4" "--micro-batch-size 64 --micro-batch-tokens 14336"; do $PY benchmarks/bench_trainer.py --qwen3-8b-shape --layers 2 --num-samples 64 --prompt-len 512 --completion-len 3072 --completion-len-min 64 --logits-chunk-size 4096 $v --warmup 1 --steps 3 --no-phases || exit 1; done'
# the pieces' products one by one against the plain step's (Triton forward, cuBLAS backward), every tile config
add_step pieces_products 420 '$PY benchmarks/bench_pieces_products.py ${PIECES_BENCH_ARGS:---sweep} --out "$OUT/pieces_products.md"'
add_step layout_invariance_dp2 500 "\$PY -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_layout_invariance.py --device cuda $LAYOUT_ARGS"
add_step engine_tp_pieces 500 '$PY benchmarks/bench_engine.py --qwen3-8b-shape --num-requests 64 --modes deterministic --no-hf --tp-emulation 1,8 --json "$OUT/engine_tp_pieces.json"'
# the same with RLREPRO_PIECES_FLATTEN=0 then 1 (one K loop over the pieces; the default, auto, flattens pieces of
# <= 16 K tiles; the same bits), and the bit tests of that kernel first
add_step engine_tp_pieces_flatten 560 '$PY -m pytest -m gpu -q -p no:cacheprovider tests/test_tp_pieces_fast.py -k flattened && for f in 0 1; do RLREPRO_PIECES_FLATTEN=$f $PY benchmarks/bench_engine.py --qwen3-8b-shape --num-requests 64 --modes deterministic --no-hf --tp-emulation 1,8 --json "$OUT/engine_tp_pieces_flatten$f.json" || exit 1; done'
add_step bench_kernels 400 '$PY benchmarks/bench_kernels.py --out "$OUT/bench_kernels.md" ${BENCH_ARGS:-}'
add_step grpo 560 'kit && GRPO_SET=one bash scripts/gpu_grpo.sh'
# GRPO with FA3's bits (RLREPRO_ATTENTION=fa3): two runs on other engine batch settings, the logprobs on-policy
add_step grpo_fa3 500 'kit && fi_kit && RLREPRO_ATTENTION=fa3 GRPO_SET=fa3 bash scripts/gpu_grpo.sh'
# train.layout_invariant=true, 8 TP pieces, on 1 GPU through rlrepro train: two runs diffed, on-policy (issue #26)
add_step grpo_layout 400 'kit && GRPO_SET=layout GRPO_STEPS=${GRPO_STEPS:-2} bash scripts/gpu_grpo.sh'
add_step grpo_two 560 'kit && GRPO_SET=two bash scripts/gpu_grpo.sh'
# rollout.max_staleness K=0, 1, 2 on one GPU (issue #25): step and phase times, K=1 runs diffed
add_step pipeline 560 'kit && GRPO_SET=pipeline bash scripts/gpu_grpo.sh'
# nvidia-h200-x2: the whole 36-layer model through rlrepro train (megatron TP=2, 2 colocated engines, CUDA IPC)
add_step grpo_full 590 'kit && GRPO_SET=full GRPO_LAYERS=36 GRPO_STEPS=${GRPO_STEPS:-3} bash scripts/gpu_grpo.sh'
# nvidia-h200-x8 only: the recipe's layout, the full 36 layers, then 2 layers to compare with grpo_two
add_step grpo_eight 590 'kit && GRPO_SET=eight GRPO_LAYERS=36 bash scripts/gpu_grpo.sh && OUT=$OUT/l2 GRPO_SET=eight GRPO_WORK=/tmp/grpo_eight_l2 bash scripts/gpu_grpo.sh'
# the full 36-layer Qwen3-8B shape: 64 and 256 requests, 512/512 tokens, each with transformers generate. Every
# system is warmed by a whole-size generate first, so both halves together can outrun one 600 s device call: the
# 64-request half alone is bench_engine_64, the 256 one `ENGINE_BENCH_ARGS=--no-hf` or a call of its own
add_step bench_engine 580 '
  $PY benchmarks/bench_engine.py --qwen3-8b-shape --num-requests 64 ${ENGINE_BENCH_ARGS:-} --json "$OUT/bench_engine_64.json"
  $PY benchmarks/bench_engine.py --qwen3-8b-shape --num-requests 256 ${ENGINE_BENCH_ARGS:-} --json "$OUT/bench_engine_256.json"'
# where a steady-state decode step's time goes (64 requests, context ~P+O), per kernel
add_step breakdown_engine 300 '$PY benchmarks/bench_engine.py --qwen3-8b-shape --num-requests 64 --output-len 256 --breakdown ${ENGINE_BENCH_ARGS:-}'
# one GRPO train step at the Qwen3-8B width: time, phases, MFU, and the top kernels
add_step bench_trainer 300 'kit && $PY benchmarks/bench_trainer.py --qwen3-8b-shape --layers 2 --profile --json "$OUT/bench_trainer.json"'
# nvidia-h200-x2 (2 GPUs): the full 36-layer Qwen3-8B trainer, megatron backend at TP=2 (~74 GB + activations per GPU)
add_step bench_trainer_tp2 400 'kit && $PY benchmarks/bench_trainer.py --qwen3-8b-shape --layers 36 --tensor-parallel 2 --json "$OUT/bench_trainer_tp2.json"'
# nvidia-h200-x2: the full 36-layer trainer, data parallel over 2 GPUs with ZeRO-1 (~115 GB of state per GPU)
add_step bench_trainer_dp2 300 'kit && $PY benchmarks/bench_trainer.py --qwen3-8b-shape --layers 36 --num-gpus 2 --distributed-optimizer --no-phases --json "$OUT/bench_trainer_dp2.json"'
# nvidia-h200-x2: the same, megatron-core's DDP + DistributedOptimizer (train.grad_sync) against rlrepro's, one after the other
add_step bench_trainer_grad_sync 560 'kit && for gs in megatron ordered; do $PY benchmarks/bench_trainer.py --qwen3-8b-shape --layers 36 --num-gpus 2 --distributed-optimizer --no-phases --grad-sync $gs --json "$OUT/dp2_$gs.json" || exit 1; done'
# the sampler's chunk skipping, unconverted t = 1 logits and picked logprob (2026-12-08): its GPU tests, the kernels
# before/after, and the engine at 64 requests with RLREPRO_SAMPLER_LEAN=0/1 in ABBA rounds (same outputs' digest)
add_step sampler_lean 560 'kit; $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_rollout_cuda.py -k "fused_sampler or picked or logprobs_equal"; $PY benchmarks/bench_kernels.py --only sampler --out "$OUT/sampler.md"; $PY benchmarks/bench_engine.py --qwen3-8b-shape --num-requests ${SAMPLER_REQUESTS:-64} --modes deterministic --no-hf --sampler-ab --repeat ${SAMPLER_ROUNDS:-2} --json "$OUT/engine_sampler_ab.json"'
# the 64-request half of bench_engine alone (deterministic, fast, transformers)
add_step bench_engine_64 300 '$PY benchmarks/bench_engine.py --qwen3-8b-shape --num-requests 64 ${ENGINE_BENCH_ARGS:-} --json "$OUT/bench_engine_64.json"'
# the deterministic engine against transformers at 64 requests, three rounds in turn: the per-round speedups and
# their median (transformers' rate moves by ~25 % between runs)
add_step bench_engine_repeat 420 '$PY benchmarks/bench_engine.py --qwen3-8b-shape --num-requests 64 --modes deterministic --repeat 3 --json "$OUT/bench_engine_repeat.json"'
# GRPO groups: the copies of a prompt sharing its K/V within the step, against each computing it (one run)
add_step group_prefill 300 '$PY benchmarks/bench_group_prefill.py --qwen3-8b-shape ${GROUP_PREFILL_ARGS:---layers 36 --prompts 16 --group 8 --prompt-len 1024 --output-len 64}'
add_step probe_decode_loop 200 '$PY benchmarks/probe_decode_loop.py'
# multi-turn episodes against single-turn requests on one engine (issue #24): the 36-layer Qwen3-8B shape, 64
# episodes x 3 turns x 128 tokens with 32-token observations, the python-sandbox tool, ratios in one run.
# tests/test_episodes.py is not run here: its fixtures build the tiny model on the CPU only (no device argument)
add_step episodes 420 '$PY benchmarks/bench_episodes.py --qwen3-8b-shape --json "$OUT/bench_episodes.json" ${EPISODES_BENCH_ARGS:-}'
add_step profile_engine 300 '$PY benchmarks/bench_engine.py --qwen3-8b-shape --num-requests 64 --output-len 128 --no-hf --modes deterministic --profile 20'


# ---------------------------------------------------------------------------------------------- runner
export PY OUT ROOT
selected=("$@")
results=()
overall=0
for i in "${!STEP_NAMES[@]}"; do
  name=${STEP_NAMES[$i]}
  if [ ${#selected[@]} -gt 0 ] && [[ ! " ${selected[*]} " == *" $name "* ]]; then
    continue
  fi
  log="$OUT/$name.log"
  echo "=== [$name] start $(date -u +%H:%M:%S) -> $log"
  start=$(date +%s)
  limit=${STEP_TIMEOUTS[$i]}
  [ -n "${GPU_CHECK_MAX_S:-}" ] && [ "$GPU_CHECK_MAX_S" -lt "$limit" ] && limit=$GPU_CHECK_MAX_S
  export STEP_DEADLINE=$(( start + limit ))  # for steps that fit their own work into the time left
  timeout --kill-after=10 "$limit" bash -c "${STEP_CMDS[$i]}" >"$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  [ $rc -eq 0 ] && status=ok || { status="FAIL(rc=$rc)"; overall=1; }
  [ $rc -eq 124 ] && status="TIMEOUT"
  echo "=== [$name] $status in ${secs}s; last lines:"
  tail -n 15 "$log"
  results+=("$(printf '%-16s %-14s %5ss' "$name" "$status" "$secs")")
done

{
  echo "gpu_check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
  for r in "${results[@]}"; do echo "  $r"; done
} | tee "$OUT/summary.txt"
tar czf "$FINAL_OUT/results.tgz" -C "$OUT" . && cp "$OUT/summary.txt" "$FINAL_OUT/summary.txt"
echo "results: $FINAL_OUT/results.tgz (every step's log and files), $FINAL_OUT/summary.txt"
exit $overall

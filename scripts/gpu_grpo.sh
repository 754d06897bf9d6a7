#!/usr/bin/env bash
# GRPO on the GPU with the Qwen3-8B width (GRPO_LAYERS layers; 36 is the full model) and seeded random weights,
# through `rlrepro train recipe=grpo_qwen3_8b` and Ray. Needs the kit (ray, hydra, datasets, math-verify):
# `source .devkit/install.sh` first. Writes under $OUT/grpo_<set>/ (summary, diffs, and each run's records
# without checkpoints, so `rlrepro diff` can be re-run anywhere).
#
#   GRPO_SET=one  (1 GPU, colocated, CUDA IPC weight sync): a (creates the weights), b (= a?), c (other engine
#                 batch settings, = a?), f (fast kernels: the cost of determinism), d (resumed from a's step-2
#                 checkpoint, = a?)
#   GRPO_SET=two  (2 GPUs): g and h (data-parallel trainer on 2 GPUs, 2 colocated engines, CUDA IPC; g = h?),
#                 s (the recipe's layout at 2 GPUs: megatron TP=1 trainer on GPU 0, engine on GPU 1, NCCL
#                 broadcast), m1 and m2 (train.backend=megatron, TP=2; m1 = m2?), m0 (megatron TP=1, data parallel:
#                 = g?), z (g with train.distributed_optimizer=true: = g?), k1 and k2 (megatron-core's DDP gradient
#                 sync, train.grad_sync=megatron, with ZeRO-1; k1 = k2?), f2 (g in fast mode, with GRPO_FAST=1)
#   GRPO_SET=full (2 GPUs, GRPO_LAYERS=36): p1 and p2, the whole model at megatron TP=2 with 2 colocated engines
#                 (CUDA IPC weight sync of the full 8B policy; p1 = p2?)
#   GRPO_SET=fa3  (1 GPU, colocated, with RLREPRO_ATTENTION=fa3 and flashinfer): a, and c (other engine batch
#                 settings, = a?)
#   GRPO_SET=pipeline (1 GPU, colocated): q0 (rollout.max_staleness=0), q1/q1b/q1c (K=1: two runs and other engine
#                 settings, diffed), q2 (K=2); step and phase times for docs/BENCHMARKS.md
#   GRPO_SET=layout (1 GPU, colocated): l1 and l2, train.layout_invariant=true train.tp_partials=8 (l1 = l2?,
#                 on-policy: max lp diff 0.0)
#   GRPO_SET=eight (8 GPUs): x1 and x2, the recipe's own layout (megatron TP=1 trainer data parallel over 4 GPUs
#                 with ZeRO-1, 4 engines on their own GPUs; x1 = x2?)
# GRPO_ONLY="g h m0" (sets one, two, eight, layout, full) runs only the named runs (the first, a/g/x1/l1/p1,
# always: it creates the weights), e.g. GRPO_ONLY="a d" for the resume check alone.
# CPU smoke test of the same script: GRPO_SMALL=1 GRPO_DEVICE=cpu GRPO_DTYPE=float32 GRPO_MAX_TOKENS=8 ...
set -uo pipefail
cd "$(dirname "$0")/.."
SET=${GRPO_SET:-one}
OUT=${OUT:-$PWD/gpu_check_out}
R=$OUT/grpo_$SET
W=${GRPO_WORK:-/tmp/grpo_$SET}
rm -rf "$W" "$R" && mkdir -p "$W" "$R"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export RAY_USAGE_STATS_ENABLED=0 WANDB_MODE=offline HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
PY=${PYTHON:-python3}
M=$W/qwen3_shape
$PY scripts/make_qwen3_shape.py --out "$M" --layers "${GRPO_LAYERS:-2}" ${GRPO_SMALL:+--small} >/dev/null
STEPS=${GRPO_STEPS:-3}
COMMON=(recipe=grpo_qwen3_8b "run.device=${GRPO_DEVICE:-cuda}" "model.dtype=${GRPO_DTYPE:-bfloat16}"
        data.source=null data.synthetic.task=copy
        data.use_chat_template=false data.template=null reward.fn=hash
        "rollout.prompts_per_step=${GRPO_PROMPTS:-16}" rollout.group_size=8
        "rollout.max_tokens=${GRPO_MAX_TOKENS:-128}" rollout.max_model_len=512 rollout.gpu_memory_fraction=0.2
        "train.steps=$STEPS" train.warmup_steps=1 train.micro_batch_size=16
        logger.wandb=false checkpoint.every=0 checkpoint.save_last=false logger.progress=true)
DEF=(train.backend=default train.tensor_parallel=1 train.distributed_optimizer=false)  # the recipe's own:
# megatron TP=1, data parallel over 4 GPUs with ZeRO-1, for 8 GPUs
ONE=(train.num_gpus=1 rollout.num_workers=1 ray.colocate=true "${DEF[@]}")
TWO_GPUS=(train.num_gpus=2 rollout.num_workers=2 ray.colocate=true)
TWO=("${TWO_GPUS[@]}" "${DEF[@]}")
rc=0
want() { [ -z "${GRPO_ONLY:-}" ] || [[ " $GRPO_ONLY " == *" $1 "* ]]; }  # GRPO_ONLY="g h m0": only these runs
log() { echo "$*" | tee -a "$R/summary.txt"; }
# the first run creates the seeded random weights (model.init=random); the others load them as a checkpoint
first() { local name=$1; shift
  $PY -m rlrepro.cli train "${COMMON[@]}" model.init=random "model.path=$M" "run.dir=$W/$name" "$@" || rc=1
  BASE=$W/$name/base_model; }
train() { local name=$1; shift
  $PY -m rlrepro.cli train "${COMMON[@]}" model.init=pretrained "model.path=$BASE" "run.dir=$W/$name" "$@" || rc=1; }
diffrun() { $PY -m rlrepro.cli diff "$W/$1" "$W/$2" > "$R/diff_$1_$2.txt" 2>&1; log "diff $1 $2 ($3): exit $?"; }

if [ "$SET" = fa3 ]; then
  # the deterministic mode with FA3's bits (RLREPRO_ATTENTION=fa3, set by the caller; flashinfer on the path): two
  # runs on other engine batch settings (= a?), the trainer's logprobs against the engine's (max lp diff 0?)
  first a "${ONE[@]}"
  train c "${ONE[@]}" rollout.max_num_seqs=7 rollout.max_num_batched_tokens=999
  diffrun a c "other engine batch settings"
  RUNS="a c"
elif [ "$SET" = one ]; then
  first a "${ONE[@]}" checkpoint.every=2
  want b && { train b "${ONE[@]}"; diffrun a b "two runs"; }
  want c && { train c "${ONE[@]}" rollout.max_num_seqs=7 rollout.max_num_batched_tokens=999
              diffrun a c "other engine batch settings"; }
  want f && train f "${ONE[@]}" run.deterministic=false
  if want d; then
    mkdir -p $W/d/checkpoints && cp -r $W/a/checkpoints/step_000002 $W/d/checkpoints/
    train d "${ONE[@]}" run.resume=true; diffrun a d "resumed at step 2"
  fi
  RUNS=$(for n in a b c f d; do [ -d "$W/$n" ] && echo "$n"; done)
elif [ "$SET" = pipeline ]; then
  # rollout.max_staleness (issue #25) on 1 GPU, colocated (the only layout one GPU allows): K=0 (q0, creates the
  # weights), K=1 twice (q1, q1b: = q1?), K=1 with 2 engines on other batch settings (q1c: = q1?), K=2 (q2); the
  # decoupled objective with TIS for K>0. The step's phase times give the overlap model of a 2-GPU layout.
  PIPE=("${ONE[@]}" "train.steps=${GRPO_PIPE_STEPS:-6}")
  first q0 "${PIPE[@]}"
  train q1 "${PIPE[@]}" rollout.max_staleness=1 train.decoupled=true train.is_correction=tis
  train q1b "${PIPE[@]}" rollout.max_staleness=1 train.decoupled=true train.is_correction=tis
  diffrun q1 q1b "two runs, K=1"
  train q1c "${PIPE[@]}" rollout.max_staleness=1 train.decoupled=true train.is_correction=tis \
    rollout.max_num_seqs=7 rollout.max_num_batched_tokens=999
  diffrun q1 q1c "K=1, other engine batch settings"
  train q2 "${PIPE[@]}" rollout.max_staleness=2 train.decoupled=true train.is_correction=tis
  RUNS="q0 q1 q1b q1c q2"
elif [ "$SET" = layout ]; then
  # train.layout_invariant with 8 TP pieces (issue #26) on 1 GPU, colocated: l1 (creates the weights) and l2 (= l1?);
  # the engine emulates the 8 pieces, so "max lp diff" (trainer vs rollout logprobs) must be 0.0
  LAYOUT=("${ONE[@]}" train.layout_invariant=true train.tp_partials=8)
  first l1 "${LAYOUT[@]}"
  want l2 && { train l2 "${LAYOUT[@]}"; diffrun l1 l2 "two runs, layout_invariant with 8 pieces"; }
  RUNS=$(for n in l1 l2; do [ -d "$W/$n" ] && echo "$n"; done)
elif [ "$SET" = eight ]; then
  # the recipe's own layout for one 8-GPU node (nvidia-h200-x8): 4 engines on GPUs of their own, the trainer
  # (megatron TP=1, DP=4, ZeRO-1) on the other 4, NCCL broadcast; GRPO_LAYERS=36 for the full model, 2 to compare
  # with set two
  first x1
  want x2 && { train x2; diffrun x1 x2 "two runs, the recipe's 8-GPU layout"; }
  RUNS=$(for n in x1 x2; do [ -d "$W/$n" ] && echo "$n"; done)
elif [ "$SET" = full ]; then
  # the whole model (GRPO_LAYERS=36) on 2 GPUs with colocated engines: only megatron TP=2 fits beside an engine
  # (~84 GiB of trainer state a GPU; DP=2 + ZeRO-1 needs ~133 GiB). p1 creates the weights; p2 = p1?
  # The engine's KV pool is cut to 5% of the GPU (7 GiB: 64 sequences x 512 tokens need 4.7 GiB) and the
  # micro-batch to 8: with the set's default 20% and 16, step 1 ran out of memory (trainer 88 GiB + engine 51 GiB).
  FULL=("${TWO_GPUS[@]}" train.backend=megatron train.tensor_parallel=2 rollout.gpu_memory_fraction=0.05
        train.micro_batch_size=8)
  first p1 "${FULL[@]}"
  want p2 && { train p2 "${FULL[@]}"
               diffrun p1 p2 "two runs, full model, megatron TP=2"; }
  RUNS=$(for n in p1 p2; do [ -d "$W/$n" ] && echo "$n"; done)
else
  first g "${TWO[@]}"
  want h && { train h "${TWO[@]}"; diffrun g h "two runs, 2 GPUs"; }
  # the recipe's 8-GPU layout (engines on GPUs of their own, megatron trainer) scaled down to 2 GPUs: TP=1 trainer
  # on GPU 0, one engine on GPU 1, weights by NCCL broadcast
  want s && train s train.num_gpus=1 rollout.num_workers=1 ray.colocate=false train.backend=megatron \
    train.tensor_parallel=1
  # megatron backend, TP=2 over the 2 GPUs; the engines emulate its reduction (docs/MEGATRON.md)
  want m1 && train m1 "${TWO_GPUS[@]}" train.backend=megatron train.tensor_parallel=2
  want m2 && { train m2 "${TWO_GPUS[@]}" train.backend=megatron train.tensor_parallel=2
               diffrun m1 m2 "two runs, megatron TP=2"; }
  # megatron TP=1 (data parallel over the 2 GPUs): the same math as the default backend, so the same run as g
  want m0 && { train m0 "${TWO_GPUS[@]}" train.backend=megatron train.tensor_parallel=1
               diffrun g m0 "megatron TP=1 vs default"; }
  # the optimizer state sharded over the 2 data-parallel ranks (ZeRO-1, NCCL broadcasts): the same run as g
  want z && { train z "${TWO[@]}" train.distributed_optimizer=true; diffrun g z "distributed optimizer vs g"; }
  # megatron-core's DDP + DistributedOptimizer (train.grad_sync=megatron) at TP=1 x DP=2: two runs
  MC=("${TWO_GPUS[@]}" train.backend=megatron train.tensor_parallel=1 train.grad_sync=megatron
      train.distributed_optimizer=true)
  want k1 && train k1 "${MC[@]}"
  want k2 && { train k2 "${MC[@]}"; diffrun k1 k2 "two runs, megatron-core DDP + DistributedOptimizer"; }
  [ -n "${GRPO_FAST:-}" ] && train f2 "${TWO[@]}" run.deterministic=false
  RUNS=$(for n in g h s m1 m2 m0 z k1 k2 f2; do [ -d "$W/$n" ] && echo "$n"; done)
fi

$PY - "$W" $RUNS <<'PYEOF' | tee -a "$R/summary.txt"
import json, sys
from pathlib import Path
w, names = Path(sys.argv[1]), sys.argv[2:]
def load(name):
    p = w / name / "metrics.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []
keys = ["perf/step_time_s", "perf/rollout_s", "perf/reward_s", "perf/train_s", "perf/sync_s",
        "perf/rollout_tokens_per_s", "perf/train_tokens_per_s", "perf/mfu", "perf/overlap_s"]
print("averages over steps 2.. (step 1 includes compilation and CUDA-graph capture)")
print("| run | steps | " + " | ".join(k.split("/")[1] for k in keys) + " | peak GiB (actor) | max lp diff |")
print("|---|---|" + "---|" * (len(keys) + 2))
for name in names:
    every = load(name)
    m = every[1:] or every
    if not m:
        print(f"| {name} | 0 |"); continue
    avg = [sum(x.get(k, float("nan")) for x in m) / len(m) for k in keys]
    mem = {k.split("peak_mem_gib_")[1]: max(x[k] for x in every if k in x) for k in every[0] if "peak_mem_gib" in k}
    lp = max(x["train/rollout_logprob_abs_diff"] for x in every)
    print(f"| {name} | {len(every)} | " + " | ".join(f"{v:.3g}" for v in avg) + " | "
          + ", ".join(f"{v:.1f} ({k})" for k, v in mem.items()) + f" | {lp:.3g} |")
PYEOF
# the two-run overlay (reward, loss, KL, entropy, length, grad norm): the curves lie on top of each other
case $SET in
  one) PAIR="a b" ;; layout) PAIR="l1 l2" ;; pipeline) PAIR="q1 q1b" ;; eight) PAIR="x1 x2" ;; full) PAIR="p1 p2" ;;
  *) PAIR="g h" ;;
esac
PLOT_RUNS=$(for n in $PAIR; do [ -d "$W/$n" ] && echo "$W/$n"; done)
if [ "$(echo "$PLOT_RUNS" | wc -w)" -eq 2 ]; then  # GRPO_ONLY may have left one of the pair out
  $PY -m rlrepro.cli plot $PLOT_RUNS --out "$R/plots" > /dev/null 2>&1 || log "plot failed"
else
  log "plot skipped: the pair ($PAIR) did not both run"
fi
for n in $RUNS; do  # records only: diff-able anywhere with `rlrepro diff`
  [ -d "$W/$n" ] && mkdir -p "$R/runs/$n" && cp "$W/$n"/*.jsonl "$W/$n/config.yaml" "$R/runs/$n/" 2>/dev/null
done
exit $rc

#!/usr/bin/env bash
# GRPO on the GPU with the Qwen3-8B width (GRPO_LAYERS layers; 36 is the full model) and seeded random weights:
# two runs + diff, a run with other engine batch settings + diff, a resumed run + diff, and fast mode for
# the cost comparison. Needs the kit (ray, hydra, datasets, math-verify): `source .devkit/install.sh` first.
# Writes under $OUT/grpo/ and prints a summary table.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
W=${GRPO_WORK:-/tmp/grpo}
rm -rf "$W" && mkdir -p "$W" "$OUT"
export PYTHONPATH=$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}
export RAY_USAGE_STATS_ENABLED=0 WANDB_MODE=offline HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
PY=${PYTHON:-python3}
M=$W/qwen3_shape
$PY scripts/make_qwen3_shape.py --out "$M" --layers "${GRPO_LAYERS:-2}" ${GRPO_SMALL:+--small} >/dev/null
COMMON=(recipe=grpo_qwen3_8b "run.device=${GRPO_DEVICE:-cuda}" "model.dtype=${GRPO_DTYPE:-bfloat16}"
        data.source=null data.synthetic.task=copy
        data.use_chat_template=false data.template=null reward.fn=systems_reward:pseudo_reward
        rollout.num_workers=1 "rollout.prompts_per_step=${GRPO_PROMPTS:-16}" rollout.group_size=8
        "rollout.max_tokens=${GRPO_MAX_TOKENS:-128}" rollout.max_model_len=512 rollout.gpu_memory_fraction=0.2
        "train.steps=${GRPO_STEPS:-3}" train.warmup_steps=1 train.micro_batch_size=16 train.num_gpus=1 ray.colocate=true
        logger.wandb=false checkpoint.every=2 logger.progress=true)
# run a creates the seeded random weights (model.init=random); the others load them as a checkpoint
train() { $PY -m rlrepro.cli train "${COMMON[@]}" model.init=pretrained "model.path=$W/a/base_model" "$@"; }
rc=0
$PY -m rlrepro.cli train "${COMMON[@]}" model.init=random "model.path=$M" run.dir=$W/a || rc=1
train run.dir=$W/b || rc=1
$PY -m rlrepro.cli diff $W/a $W/b > "$OUT/grpo_diff_ab.txt" 2>&1; echo "diff a b: exit $?" | tee -a "$OUT/grpo_summary.txt"
train run.dir=$W/c rollout.max_num_seqs=7 rollout.max_num_batched_tokens=999 || rc=1
$PY -m rlrepro.cli diff $W/a $W/c > "$OUT/grpo_diff_ac.txt" 2>&1; echo "diff a c (other batch settings): exit $?" | tee -a "$OUT/grpo_summary.txt"
train run.dir=$W/f run.deterministic=false || rc=1
$PY - "$W" <<'PYEOF' | tee -a "$OUT/grpo_summary.txt"
import json, sys
from pathlib import Path
w = Path(sys.argv[1])
def load(name):
    p = w / name / "metrics.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []
keys = ["perf/step_time_s", "perf/rollout_s", "perf/reward_s", "perf/train_s", "perf/sync_s", "perf/rollout_tokens_per_s"]
print("| run | steps | " + " | ".join(k.split("/")[1] for k in keys) + " | max logprob diff |")
print("|---|---|" + "---|" * (len(keys) + 1))
for name in ("a", "b", "c", "d", "f"):
    m = load(name)[1:]  # step 1 includes compilation and graph capture
    if not m:
        print(f"| {name} | 0 |"); continue
    avg = [sum(x[k] for x in m) / len(m) for k in keys]
    lp = max(x["train/rollout_logprob_abs_diff"] for x in load(name))
    print(f"| {name} | {len(m)} | " + " | ".join(f"{v:.3f}" for v in avg) + f" | {lp:.3g} |")
PYEOF
cp $W/a/metrics.jsonl "$OUT/grpo_a_metrics.jsonl" 2>/dev/null
# last, so that a short time limit still leaves the table above
mkdir -p $W/d/checkpoints && cp -r $W/a/checkpoints/step_000002 $W/d/checkpoints/
train run.dir=$W/d run.resume=true || rc=1
$PY -m rlrepro.cli diff $W/a $W/d > "$OUT/grpo_diff_ad.txt" 2>&1; echo "diff a d (resumed at step 2): exit $?" | tee -a "$OUT/grpo_summary.txt"
exit $rc

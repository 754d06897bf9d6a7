#!/usr/bin/env bash
# Debug a hang of the 2-GPU colocated run: one short run with Python stack dumps (RLREPRO_STACK_DUMP_S) and
# NCCL_DEBUG=INFO, then the driver log and every Ray worker log packed into $OUT/debug_two.tgz.
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} RAY_USAGE_STATS_ENABLED=0 WANDB_MODE=offline HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
export RLREPRO_STACK_DUMP_S=${DUMP_S:-90} NCCL_DEBUG=INFO
W=/tmp/dbg; rm -rf $W; mkdir -p $W
python3 scripts/make_qwen3_shape.py --out $W/m --layers 2 >/dev/null
timeout ${RUN_S:-150} python3 -m rlrepro.cli train recipe=grpo_qwen3_8b run.device=cuda model.dtype=bfloat16 \
  data.source=null data.synthetic.task=copy data.use_chat_template=false data.template=null reward.fn=hash \
  rollout.prompts_per_step=4 rollout.group_size=8 rollout.max_tokens=32 rollout.max_model_len=512 \
  rollout.gpu_memory_fraction=0.2 train.steps=2 train.warmup_steps=1 train.micro_batch_size=16 logger.wandb=false \
  checkpoint.every=0 checkpoint.save_last=false model.init=random model.path=$W/m run.dir=$W/g \
  train.num_gpus=2 rollout.num_workers=2 ray.colocate=true ${EXTRA:-} > $W/driver.log 2>&1
echo "train exit $?" >> $W/driver.log
mkdir -p $W/raylogs && cp /tmp/ray/session_latest/logs/worker-*.{err,out} /tmp/ray/session_latest/logs/raylet.out $W/raylogs/ 2>/dev/null
tar czf "$OUT/debug_two.tgz" -C $W driver.log raylogs
tail -5 $W/driver.log

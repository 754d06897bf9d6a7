#!/usr/bin/env bash
# The algorithms of issue #23 end to end on the CPU, each a full grpo_tiny run (80 steps):
#   rloo + dynamic sampling + evaluation every 10 steps + HF export, twice (the second with 2 rollout workers and
#   other engine batch settings: `rlrepro diff --strict` must exit 0), then GSPO and CISPO, then REINFORCE++.
# Each run's reward first -> last (summary.json) is printed next to plain grpo_tiny's; the exported model of every
# run is loaded by transformers' Qwen3ForCausalLM and its logits compared with rlrepro's.
#   scripts/algorithms_check.sh [OUT_DIR]        (default runs/algorithms; ~2-4 min per run on 2 cores)
set -euo pipefail
OUT=${1:-runs/algorithms}
export HF_HUB_OFFLINE=1 WANDB_MODE=offline RAY_USAGE_STATS_ENABLED=0
mkdir -p "$OUT"
python - "$OUT/held_out.jsonl" <<'EOF'
import sys
from rlrepro.data import make_synthetic_records, write_jsonl
# the recipe's task (first_letter over 'abcd') from another seed: prompts the run never trains on
write_jsonl(make_synthetic_records("first_letter", 64, 12345, alphabet="abcd"), sys.argv[1])
EOF
COMMON=(recipe=grpo_tiny logger.progress=false checkpoint.export_hf=true eval.every=10
        "eval.source=$OUT/held_out.jsonl" eval.num_samples=4)
DS=(rollout.dynamic_sampling=true rollout.max_generation_rounds=3)
run() { local name=$1; shift; echo "== $name: rlrepro train $*"; /usr/bin/time -f "   $name: %e s wall" \
        rlrepro train "${COMMON[@]}" "run.dir=$OUT/$name" run.overwrite=true "$@" 2> "$OUT/$name.log" \
        || { tail -30 "$OUT/$name.log"; exit 1; }; tail -1 "$OUT/$name.log"; }

run grpo                                   # the reference curve
run rloo train.advantage=rloo "${DS[@]}"
run rloo_b train.advantage=rloo "${DS[@]}" rollout.num_workers=2 rollout.max_num_seqs=48 \
    rollout.max_num_batched_tokens=333 rollout.prefix_cache=false
rlrepro diff --strict "$OUT/rloo" "$OUT/rloo_b"
echo "   rloo vs rloo_b: identical (rlrepro diff --strict exit 0)"
run gspo train.policy_loss=gspo train.loss_agg=seq-mean-token-mean train.clip_low=3e-4 train.clip_high=4e-4
run cispo train.policy_loss=cispo train.clip_low=1.0 train.clip_high=0.28 train.ppo_epochs=2  # one on-policy epoch: = GRPO's gradient
run reinforce_pp_baseline train.advantage=reinforce_pp_baseline

python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
import torch, transformers
from rlrepro.model import load_pretrained
out = Path(sys.argv[1])
ids = torch.tensor([[(7 * i + 3) % 60 for i in range(29)]])
print(f"{'run':<24}{'reward first':>14}{'last':>8}{'eval avg@4 first':>18}{'last':>8}{'kept/step':>11}"
      f"{'transformers |dlogit|/max':>27}")
for name in ("grpo", "rloo", "rloo_b", "gspo", "cispo", "reinforce_pp_baseline"):
    s = json.loads((out / name / "summary.json").read_text())
    ev = s["eval"].get("eval/avg@4", {})
    m = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    kept = [r["rollout/groups_kept"] for r in m if "rollout/groups_kept" in r]
    hf_dir = s["files"]["exported_model"]
    hf = transformers.Qwen3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        ref, got = hf(ids).logits, load_pretrained(hf_dir, dtype=torch.float32)(ids)
    rel = float((got - ref).abs().max() / ref.abs().max())
    assert rel <= 1e-4, (name, rel)  # tests/test_model.py's parity tolerance
    assert s["reward"]["last"] > s["reward"]["first"] + 0.2, (name, s["reward"])  # it learns
    print(f"{name:<24}{s['reward']['first']:>14.3f}{s['reward']['last']:>8.3f}{ev.get('first', float('nan')):>18.3f}"
          f"{ev.get('last', float('nan')):>8.3f}{(sum(kept) / len(kept) if kept else float('nan')):>11.1f}{rel:>27.2e}")
EOF

#!/usr/bin/env bash
# The mini-reproduction (docs/results/mini-reproduction.md): three recurrent arms of recipes/mini/smollm2-242.yaml and the
# parent trained on the same tokens, on CPU; each run evaluated over training (loss, GSM8K) from its snapshots;
# the paper's figures and tables from those evaluations. 1 h 29 min on 2 cores (docs/results/mini-reproduction.md).
#
#   ./scripts/mini-reproduction.sh [OUT]       # default OUT: runs/mini; finished stages are skipped on re-run
set -euo pipefail
cd "$(dirname "$0")/.."
recurfit=${RECURFIT:-.venv/bin/recurfit}
out=${1:-runs/mini}
recipe=recipes/mini/smollm2-242.yaml

[ -d data/prose ] || "$recurfit" data prepare --source embedded:prose --seq-len 256 --out data/prose
[ -d data/math ] || "$recurfit" data prepare --source embedded:math:4000 --seq-len 256 --out data/math

declare -A arms=(
  [pretrained]=""                      # the recipe as written: pretrained init, constant mean recurrence 4
  [random]="model.init=random"         # (a) the same shape from the scaled random init
  [1-sqrt]="depth.curriculum=1-sqrt"   # (c) mean recurrence ramped 1 -> 4 over the first 75% of steps
  [parent]="model.shape=null"          # the non-recurrent baseline: the 30-layer parent trained on the same tokens
)
for arm in pretrained random 1-sqrt parent; do
  [ -d "$out/$arm/final" ] || "$recurfit" train "$recipe" "out=$out/$arm" ${arms[$arm]}
  # Every snapshot (steps 0, 40, 80) at the mean training recurrence, the final model at r = 1..32 as well; an
  # evaluation continues where it stopped. (b) loss against the untrained 30-layer parent; GSM8K accuracy.
  for store in math prose; do
    "$recurfit" eval loss "$out/$arm" --data "data/$store" --recurrence 1,2,4,8,16,32 --baseline embedded \
      --out "$out/eval/$arm-$store"
  done
  "$recurfit" eval tasks "$out/$arm" --tasks gsm8k_cot --limit 16 --max-new-tokens 128 --recurrence 1,4,32 \
    --out "$out/eval/$arm-gsm8k"
done

# Math loss and GSM8K over training FLOPs, at the end against r, bars, the Table 1-style tables; training curves.
"$recurfit" plot "$out"/eval/*-math "$out"/eval/*-gsm8k "$out/pretrained" "$out/random" "$out/1-sqrt" \
  --out "$out/figures"
"${PYTHON:-.venv/bin/python}" - "$out" <<'SUMMARY'   # one table for docs/results/mini-reproduction.md
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from recurfit.evaluate.over_training import RunEvaluation
from recurfit.train.metrics import read_log

out = Path(sys.argv[1])
steps = [1, 2, 4, 8, 32]


def state_gain(model: Path) -> float:
    """Spectral norm of the adapter's state half: how strongly each core pass can depend on the last one."""
    with safe_open(model / "model.safetensors", "pt") as weights:
        adapter = weights.get_tensor("model.adapter.weight").float()
    return torch.linalg.matrix_norm(adapter[:, : adapter.shape[0]], 2).item()


def losses(arm: str, store: str) -> tuple[dict[int, float], float]:
    """Validation loss at each test recurrence, and the parent's."""
    sweep = RunEvaluation.load(out / "eval" / f"{arm}-{store}").final
    return {row.steps: row.metrics["loss"] for row in sweep.rows}, sweep.parent.metrics["loss"]


print("| arm | training TFLOPs | " + " | ".join(f"math r={r}" for r in steps) + " | prose r=4 | ‖A_s‖₂ |")
print("|---|---|" + "---|" * (len(steps) + 2))
for arm in ["pretrained", "random", "1-sqrt"]:
    flops = [record for record in read_log(out / arm) if record["kind"] == "train"][-1]["flops"]
    (math, parent_math), (prose, parent_prose) = losses(arm, "math"), losses(arm, "prose")
    print(f"| {arm} | {flops / 1e12:.1f} | " + " | ".join(f"{math[r]:.3f}" for r in steps)
          + f" | {prose[4]:.3f} | {state_gain(out / arm / 'final'):.3f} |")
trained = {store: RunEvaluation.load(out / "eval" / f"parent-{store}").final.rows[0].metrics["loss"] for store in ("math", "prose")}
flops = [record for record in read_log(out / "parent") if record["kind"] == "train"][-1]["flops"]
print(f"| parent (trained, 30 layers) | {flops / 1e12:.1f} | " + " | ".join(f"{trained['math']:.3f}" for _ in steps)
      + f" | {trained['prose']:.3f} | |")
print("| parent (untrained, 30 layers) | | " + " | ".join(f"{parent_math:.3f}" for _ in steps)
      + f" | {parent_prose:.3f} | |")
SUMMARY

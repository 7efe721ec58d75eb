#!/usr/bin/env bash
# The draft families side by side on the ShareGPT real check (docs/families.md, "Measured"):
# SmolLM2-135M-Instruct on 2 CPU cores, the same regenerated answers and the same minutes of
# training for each family, τ at k = 3 on the same held-out prompts. Run it on a quiet machine,
# from the project root, after `make install`:
#
#   bash scripts/families_realcheck.sh                 # 6 minutes each, 120 answers (≈ 40 min in all)
#   MINUTES=30 ANSWERS=480 bash scripts/families_realcheck.sh     # make sharegpt-30m's scale (≈ 3 h)
#   FAMILIES="eagle3 dflash dspark" MINUTES=10 ANSWERS=480 bash scripts/families_realcheck.sh
#   STAGE=benchmarks BENCH_LIMIT=8 MINUTES=30 ANSWERS=480 bash scripts/families_realcheck.sh
#
# STAGE=benchmarks decodes the first BENCH_LIMIT prompts of MT-Bench and HumanEval (64 new tokens a
# turn) with each family's trained draft at k = 3 (3,1,4) and at a whole block (7,1,8; for EAGLE3
# seven chained steps), into <family>/benchmarks.json and report/benchmarks.md.
# BENCHMARKS=mt-bench,humaneval,sharegpt adds held-out ShareGPT conversations, every turn: about
# 20 minutes a family on 2 cores at BENCH_LIMIT=8.
#
# Each family's run goes to runs/families-<ANSWERS>a-<MINUTES>m/<family>/ (results.json, results.md);
# a second call goes on where the first stopped (scripts/sharegpt_realcheck.py's stages resume).
set -euo pipefail
MINUTES=${MINUTES:-6}
ANSWERS=${ANSWERS:-120}
FAMILIES=${FAMILIES:-eagle3 eagle31 dflash dflash2 dspark}
OUT=runs/families-${ANSWERS}a-${MINUTES}m
export OMP_NUM_THREADS=2 PYTHONPATH=.
CHECK=(.venv/bin/python scripts/sharegpt_realcheck.py --config examples/sharegpt-realcheck.yaml --answers "$ANSWERS"
       --heldout-prompts 32 --validation-prompts 8 --eval-new-tokens 64 --eval-splits heldout)
mkdir -p "$OUT"
if [ "${STAGE:-train}" = benchmarks ]; then
  for family in $FAMILIES; do
    .venv/bin/python -m specforge_core.evaluate --config "$OUT/$family/realcheck.yaml" --draft "$OUT/$family" \
        --benchmarks "${BENCHMARKS:-mt-bench,humaneval}" --limit "${BENCH_LIMIT:-12}" --max-new-tokens 64 --batch-size 8 \
        --settings 3,1,4 7,1,8 --report "$OUT/$family/report/benchmarks.md" > "$OUT/$family/benchmarks.json" \
        2> "$OUT/$family-benchmarks.log"
    echo "$family: benchmarks → $OUT/$family/benchmarks.json"
  done
  exit 0
fi
"${CHECK[@]}" --stages data,regenerate
for family in $FAMILIES; do
  "${CHECK[@]}" --family "$family" "output.dir=$OUT/$family" "training.time_budget=${MINUTES}m" \
      training.heldout.interval=100000 training.heldout.num_prompts=2 training.heldout.max_new_tokens=16 \
      > "$OUT/$family.log" 2>&1
  echo "$family: $(grep -o '"acceptance_length": [0-9.]*' "$OUT/$family/eval-heldout.json" | head -1)"
done

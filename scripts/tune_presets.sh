#!/usr/bin/env bash
# Produce the tuning logs shipped in the package (tuning_logs/<target key>/): every preset, tuned for
# this machine's CPU with `tvmattn tune`, TRIALS measurements each (default 64), then the shapes of
# `tvmattn bench --suite default` (core kernels, causal and not), SUITE_TRIALS each (default 32).
#
#   scripts/tune_presets.sh                 # all presets and the bench suite
#   TRIALS=128 scripts/tune_presets.sh gpt2-small bert-base     # only these presets
#
# Run it on a quiet machine: later compiles trust these measurements. It resumes: an interrupted
# run, started again, measures only what is missing. With a GPU (and a CUDA schedule with knobs),
#   tvmattn tune --preset gpt2-small --target cuda --arch sm_90 --trials 64 --log-dir tuning_logs
# adds tuning_logs/cuda-sm_90/.
set -euo pipefail
cd "$(dirname "$0")/.."
TRIALS=${TRIALS:-64}
PRESETS=("$@")
if [ ${#PRESETS[@]} -eq 0 ]; then
  read -r -a PRESETS <<< "$(python -c 'from tvmattn.models.presets import PRESETS; print(*PRESETS)')"
fi
for preset in "${PRESETS[@]}"; do
  start=$(date +%s)
  tvmattn tune --preset "$preset" --target cpu --trials "$TRIALS" --log-dir tuning_logs
  echo "== $preset: $(( $(date +%s) - start )) s wall"
done
if [ "$#" -eq 0 ]; then
  for shape in $(python -c 'from tvmattn.compiler.bench import DEFAULT_SUITE as S; print(*[",".join(map(str, s)) for s in S])'); do
    IFS=, read -r b h n d <<< "$shape"
    for causal in --no-causal --causal; do
      start=$(date +%s)
      tvmattn tune --batch "$b" --heads "$h" --seq "$n" --head-dim "$d" $causal --no-projections \
        --target cpu --trials "${SUITE_TRIALS:-32}" --log-dir tuning_logs
      echo "== suite ($b,$h,$n,$d) $causal: $(( $(date +%s) - start )) s wall"
    done
  done
fi
echo "== shipped logs:"
du -ab tuning_logs | grep '\.jsonl$' || true

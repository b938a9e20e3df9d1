#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run that fits 10 minutes (CI has none; see bench/RESULTS.md,
# "On a GPU"). Usage, from the repository root:  bash bench/gpu_check.sh   (BUDGET_S=570 by default)
#   1. the CUDA tests: fla vs torch kernels (outputs, final states, gradients; strong decays, ragged T,
#      initial state, decode after prefill), the CUDA-graph decode step against eager over 64 steps
#      at every warmed width, the compiled Muon, and the device-parametrised numerical tests,
#   2. gla_scaling with model.kernel fla against SDPA (8k and 32k tokens) and the torch form,
#   3. decode through the serving engine's CUDA-graph step, widths up to 32, contexts 512..8192,
#   4. the training step of `small`: FSDP2 on one rank, bf16, 32 x 1024 tokens, compiled per block
#      with the compiled Muon update and fused AdamW; tokens/s and MFU against the measured bf16 peak,
#   5. if the budget has time left (BUDGET_S=1200 for all): the eager/compiled fp32 training step at
#      8 x 256 (as in the CPU table) and a 1-rank NCCL pipeline training of `small` (`laplace
#      tokenize` + `laplace train`, bf16) with a resume from its checkpoint.
# Each step has its own time limit, cut to what is left of the budget, so one slow step cannot eat
# the others'; a failed step does not stop the rest; a step with under 20 s left is skipped.
# Every benchmark prints one JSON line on stdout: {"benchmark", "exit", "seconds", "result"}, where
# result is the benchmark's own JSON object (null if it failed). Logs go to $OUT (or bench/gpu-out).
# Steps 1-5 need torch, pytest, pyyaml, safetensors and the [cuda] extra (fla-core); step 6 runs the
# CLI and needs the project's light dependencies too. Nothing is downloaded.
set -uo pipefail
out=${OUT:-bench/gpu-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
deadline=$((SECONDS + ${BUDGET_S:-570}))
step() {  # step KIND NAME SECONDS CMD...   (KIND: test or bench)
  local kind=$1 name=$2 limit=$3; shift 3
  local left=$((deadline - SECONDS))
  if ((left < 20)); then
    echo "=== $name: skipped, ${left}s of the budget left"
    [[ $kind == bench ]] && echo "{\"benchmark\": \"$name\", \"exit\": null, \"seconds\": 0, \"result\": null}"
    return
  fi
  ((limit > left)) && limit=$left
  echo "=== $name (limit ${limit}s)" >&2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$? took=$((SECONDS - start))
  echo "=== $name: exit $rc after ${took} s" >&2
  if [[ $kind == bench ]]; then
    local result
    result=$(grep '^{' "$out/$name.log" | tail -n 1)
    echo "{\"benchmark\": \"$name\", \"exit\": $rc, \"seconds\": $took, \"result\": ${result:-null}}"
  else
    tail -n 15 "$out/$name.log" | cut -c1-400 >&2
  fi
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv >"$out/gpu.txt" 2>&1
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())' >>"$out/gpu.txt" 2>&1
"$py" -c 'import fla; print("fla", fla.__version__)' >>"$out/gpu.txt" 2>&1
cat "$out/gpu.txt" >&2
step test tests 170 "$py" -m pytest -q -p no:cacheprovider -rs -k "cuda or fla" tests/test_kernels.py \
  tests/test_decode_step.py tests/test_muon.py tests/test_gla.py tests/test_lm.py tests/test_gated_deltanet_layer.py
step bench gla_scaling_fla 110 "$py" bench/gla_scaling.py --device cuda --kernel fla --repeats 10 \
  --lengths 512 2048 8192 32768 --recurrent-repeats 0
step bench gdn_vs_gla 60 "$py" bench/gdn_vs_gla.py --device cuda --lengths 2048 8192 --repeats 5
step bench decode_engine 90 "$py" bench/decode.py --device cuda --engine --widths 1 8 32 --rounds 2
step bench train_step_bf16 200 "$py" bench/train_step.py --distributed --device cuda --worlds 1 --presets small \
  --precision bf16 --compile --batch 32 --seq-len 1024 --steps 5
# with the default budget the steps below are usually skipped; BUDGET_S=1200 runs them too
step bench train_step 150 "$py" bench/train_step.py --device cuda --presets small --steps 5
pipeline_train() {  # tokenize a small corpus, train `small` on one NCCL rank, then resume from its checkpoint
  local proj args
  proj=$(mktemp -d)
  args=(--root "$proj" --set model.preset=small --set train.device=cuda --set train.precision=bf16
    --set train.steps=30 --set train.checkpoint_every=10 --set train.eval_every=10 --set train.log_every=5)
  "$py" -m laplace.pipeline.cli tokenize --root "$proj" --set data.max_documents=600 &&
    "$py" -m laplace.pipeline.cli train "${args[@]}" &&
    "$py" -m laplace.pipeline.cli train "${args[@]}"  # resumes at step 30: DCP load on NCCL
}
export -f pipeline_train
export py
step test pipeline_train 420 bash -c pipeline_train

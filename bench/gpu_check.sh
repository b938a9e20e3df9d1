#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (CI has none; see bench/RESULTS.md, "On a GPU"):
#   1. the device-parametrised numerical tests ([cuda] ids) against their fp64 / torch.optim.Muon references,
#   2. the three benchmarks with --device cuda (the training step on `small`),
#   3. the training step again at a GPU-sized batch,
#   4. the distributed training step (FSDP2 + ShardedMuonAdamW, one NCCL rank),
#   5. a 1-rank NCCL pipeline training of `small` (`laplace tokenize` + `laplace train`, bf16): every
#      collective of the trainer (FSDP2's, the Muon exchange, the verdicts, DCP's) goes through NCCL,
#      which serves only cuda, so a host tensor would stop it with "No backend type associated with
#      device type cpu"; the checkpoint it writes is resumed by a second `laplace train`.
# Steps 1-4 need only torch, pytest, pyyaml and safetensors: they run from a bare checkout with PYTHONPATH.
# Step 5 runs the CLI, so it also needs the project's light dependencies (tokenizers, numpy, tqdm,
# matplotlib, psutil); nothing is downloaded (the corpus is the Python docs shipped with Python).
# Logs go to $OUT (or bench/gpu-out). Each step has its own time limit so one slow step
# cannot eat the others' time; a failed step does not stop the rest.
set -uo pipefail
out=${OUT:-bench/gpu-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s)"
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
  tail -n 15 "$out/$name.log" | cut -c1-400
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv >"$out/gpu.txt" 2>&1
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())' >>"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
step tests 150 "$py" -m pytest -q -p no:cacheprovider -k cuda tests/test_gla.py tests/test_model.py tests/test_muon.py
step gla_scaling 80 "$py" bench/gla_scaling.py --device cuda --repeats 10
step decode 50 "$py" bench/decode.py --device cuda
step train_step 150 "$py" bench/train_step.py --device cuda --presets small --steps 5
step train_step_big 120 "$py" bench/train_step.py --device cuda --presets small --batch 32 --seq-len 1024 --steps 5
step train_step_dist 150 "$py" bench/train_step.py --distributed --device cuda --worlds 1 --presets small --steps 5
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
step pipeline_train 420 bash -c pipeline_train

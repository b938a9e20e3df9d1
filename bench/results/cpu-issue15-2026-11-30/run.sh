#!/usr/bin/env bash
# As run for bench/RESULTS.md: /tmp/before is `git archive 124d29f` unpacked, /work/main this checkout.
# Issue 15's "CPU figures must not get worse": before (124d29f) and after (main) interleaved, A B B A.
set -u
PY=/work/main/.venv/bin/python
out=/tmp/cpu_compare; mkdir -p $out
run() {  # tree label
  local tree=$1 label=$2 p=""
  [ "$label" = before ] && p="-P"   # the before tree's bench/tokenize.py shadows the stdlib's
  cd $tree
  echo "== $label gla $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  PYTHONPATH=$tree $PY $p bench/gla_scaling.py --lengths 2048 8192 --repeats 5 --recurrent-repeats 1 > $out/gla_${label}_$3.log 2>&1 || echo "gla failed"
  tail -12 $out/gla_${label}_$3.log
  echo "== $label train $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  PYTHONPATH=$tree $PY $p bench/train_step.py --presets tiny --steps 5 > $out/train_${label}_$3.log 2>&1 || echo "train failed"
  tail -12 $out/train_${label}_$3.log
}
run /tmp/before before 1
run /work/main after 1
run /work/main after 2
run /tmp/before before 2

#!/bin/sh
# What two jobs sharing one GPU keep of their speed alone (space sharing),
# on a real GPU: each workload runs alone, then two copies at once on the
# same device, as Keel's executors run a declared pair (the same
# CUDA_VISIBLE_DEVICES). Prints samples/s alone, each beside the other, and
# the fraction kept. Needs torch with CUDA; `OUT` is where the logs go.
#
#   sh examples/space-sharing/share_gpu.sh
set -eu
here=$(cd "$(dirname "$0")/../pytorch" && pwd)
out=${OUT:-$(mktemp -d)}
export PYTHONPATH="$here/../../sdk/python${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
rate() { # the mean samples/s of the second half of a run's progress lines
    python3 - "$1" <<'PY'
import json, sys
rates = [json.loads(l.split(" ", 1)[1])["samples_per_s"] for l in open(sys.argv[1]) if l.startswith("KEEL_PROGRESS ")]
half = rates[len(rates) // 2:]
print(f"{sum(half) / max(len(half), 1):.0f}")
PY
}
run() { # NAME STEPS ARGS...: one run alone, then two at once
    name=$1; steps=$2; shift 2
    ck=$(mktemp -d)
    KEEL_CHECKPOINT_DIR=$ck/alone python3 "$here/train.py" --steps "$steps" "$@" > "$out/$name-alone.log" 2>&1
    KEEL_CHECKPOINT_DIR=$ck/a python3 "$here/train.py" --steps "$steps" "$@" > "$out/$name-a.log" 2>&1 &
    a=$!
    KEEL_CHECKPOINT_DIR=$ck/b python3 "$here/train.py" --steps "$steps" "$@" > "$out/$name-b.log" 2>&1 &
    b=$!
    wait $a; wait $b
    alone=$(rate "$out/$name-alone.log"); ra=$(rate "$out/$name-a.log"); rb=$(rate "$out/$name-b.log")
    python3 -c "print(f'$name: alone $alone samples/s; paired $ra and $rb; kept {($ra + $rb) / 2 / $alone:.2f} each, pair total {($ra + $rb) / $alone:.2f}x alone')"
    rm -rf "$ck"
}
nvidia-smi --query-gpu=name --format=csv,noheader || true
run light 4000 --batch-size 64 --hidden 64 --report-every 100
run medium 1500 --batch-size 1024 --hidden 1024 --layers 4 --report-every 50
run heavy 400 --batch-size 8192 --hidden 4096 --layers 4 --report-every 20

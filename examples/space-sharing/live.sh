#!/bin/bash
# Two light jobs (resnet18) on one simulated v100 under a live server:
# time sharing (max_min_fairness_perf, 4 s rounds) against space sharing
# (max_min_fairness_packed). Prints each run's job completion times.
#
#   cargo build && PATH=$PWD/target/debug:$PATH examples/space-sharing/live.sh
set -e
KEEL=${KEEL:-keel}
command -v "$KEEL" >/dev/null || { echo "keel not on PATH (cargo build; export PATH=$PWD/target/debug:$PATH)"; exit 1; }
for policy in max_min_fairness_perf max_min_fairness_packed; do
  d=$(mktemp -d)
  $KEEL server --listen 127.0.0.1:0 --data-dir $d/data --simulated-gpus 1xv100 --policy $policy \
     --round-s 0.5 --gavel-round-s 4 --resolve-interval-s 0 --progress-interval-s 0.2 --stop-grace-s 3 > $d/server.log 2>&1 &
  pid=$!
  while [ ! -s $d/data/server.addr ]; do sleep 0.1; done
  export KEEL_ADDR=$(cat $d/data/server.addr)
  for n in a b; do
    printf 'name: %s\ncommand: [keel, trainer, --speedup, "20", --report-every-s, "0.2", --checkpoint-every-steps, "50"]\ngpus: 1\nmodel: resnet18\ntotal_steps: 4000\n' $n > $d/$n.yaml
    $KEEL submit -f $d/$n.yaml -o json > /dev/null
  done
  while true; do
    s=$($KEEL jobs -o json | python3 -c 'import json,sys; j=json.load(sys.stdin); print(" ".join(x["state"] for x in j))')
    case "$s" in *running*|*pending*|*preempted*) sleep 0.5;; *) break;; esac
  done
  $KEEL jobs -o json | python3 -c '
import json,sys
jobs=json.load(sys.stdin)
jct=[(j["finished_at_ms"]-j["submitted_at_ms"])/1000 for j in jobs]
print("'$policy'", "states", [j["state"] for j in jobs], "JCT s", [round(x,1) for x in jct], "avg", round(sum(jct)/len(jct),1), "makespan", round(max(jct),1), "epochs", [j["workers"][0]["epoch"] if j["workers"] else None for j in jobs])'
  kill -TERM $pid; wait $pid || true
  rm -rf $d
done

#!/usr/bin/env bash
# The console's first draw for 1,000 jobs on 256 GPUs (issue 24's figure:
# first paint < 200 ms). Run from the repository root after
# `cargo build --release -p keel`, with headless Chromium installed. Prints
# the served page's time and size, then for seven loads the time from the
# navigation's start to the first view drawn (`data-drawn-ms`).

set -euo pipefail
K=${K:-target/release/keel}
D=$(mktemp -d)
$K server --data-dir $D/data --simulated-gpus 256xv100 --simulated-nodes 32 --http-listen 127.0.0.1:17090 --listen 127.0.0.1:17091 --round-s 1 > $D/log 2>&1 &
SERVER=$!
trap 'kill $SERVER; rm -rf $D' EXIT
sleep 3
for i in $(seq 1 1000); do
  g=$(( (i % 4) + 1 ))
  echo "{\"name\":\"job-$i\",\"command\":[\"sleep\",\"3600\"],\"gpus\":$g,\"workers\":1}" > $D/s.json
  $K --addr 127.0.0.1:17091 submit -f $D/s.json > /dev/null
done
sleep 5
$K --addr 127.0.0.1:17091 cluster status | head -5
curl -s -o $D/page.html -w "GET / : %{time_total}s, %{size_download} bytes\n" http://127.0.0.1:17090/
for i in 1 2 3 4 5 6 7; do
  chromium --headless --no-sandbox --disable-gpu --dump-dom http://127.0.0.1:17090/ 2>/dev/null | grep -o 'data-drawn-ms="[^"]*"' | head -1
done

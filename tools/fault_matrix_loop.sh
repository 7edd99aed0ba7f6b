#!/usr/bin/env bash
# Hunts the rare fault-matrix hang (issue 39 §1): runs `faults::the_fault_matrix…` and
# `faults::cancelling_at_every_stage…` in a loop on every core at once, each core shared with a busy
# loop, until SECONDS have passed. A run starts only while the time left exceeds the last run's
# length, so none is cut short; a run that lasts over 3× the first one on its core has its threads'
# kernel stacks dumped (a hang the stall watchdog missed). Writes OUT/summary.txt and the log of
# every failed run.
#   usage: tools/fault_matrix_loop.sh BINARY SECONDS OUT
#   BINARY: the integration test binary (cargo test --locked --test integration --no-run prints it)
#   CORES (environment, optional): the cores to use, as `seq` bounds "FIRST LAST"; all by default
set -u
bin=$1 dur=$2 out=$3
mkdir -p "$out"
cores=$(seq ${CORES:-0 $(($(nproc) - 1))})
echo "fault matrix loop: cores $(echo $cores), kernel $(uname -r), $(date -u), $dur s, $bin" | tee "$out/summary.txt"
busy=()
for c in $cores; do taskset -c "$c" sh -c 'while :; do :; done' & busy+=($!); done
end=$(($(date +%s) + dur))
worker() {
  local c=$1 k=0 last=0 first=0
  while [ $(($(date +%s) + last)) -lt $end ]; do
    k=$((k + 1))
    local t0 log=/tmp/fault-matrix-$c-$k.log
    t0=$(date +%s)
    taskset -c "$c" "$bin" faults::the_fault faults::cancelling >"$log" 2>&1 &
    local pid=$!
    while kill -0 $pid 2>/dev/null; do
      sleep 5
      local el=$(($(date +%s) - t0))
      if [ "$first" -gt 0 ] && [ $el -gt $((3 * first)) ] && [ ! -e "$out/stuck-$c-$k.txt" ]; then
        for t in /proc/$pid/task/*; do echo "$t $(cat "$t/comm") $(cat "$t/wchan")"; done >"$out/stuck-$c-$k.txt"
        cp "$log" "$out/"
      fi
    done
    wait $pid
    local rc=$? t1
    t1=$(date +%s)
    last=$((t1 - t0))
    [ "$first" -gt 0 ] || first=$last
    echo "core $c run $k: rc $rc, $last s, $(grep -o 'test result: [a-zA-Z]*\. [0-9]* passed; [0-9]* failed' "$log" | head -1)" >>"$out/summary.txt"
    [ $rc -eq 0 ] || cp "$log" "$out/"
    rm -f "$log"
  done
}
workers=()
for c in $cores; do worker "$c" & workers+=($!); done
wait "${workers[@]}"
kill "${busy[@]}"
echo "ended $(date -u): $(grep -c 'rc 0,' "$out/summary.txt") passed, $(grep -c 'run .*: rc [1-9]' "$out/summary.txt") failed" | tee -a "$out/summary.txt"

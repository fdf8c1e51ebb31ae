#!/usr/bin/env bash
# The accelerator benchmarks as one device call runs them (docs/hosts.md, "Running
# the device benchmarks on an accelerator host"): install the wheelhouse made here
# by scripts/device_wheels.py beside the host's JAX, then run the named parts, each
# writing its JSON and log to $OUT as it goes (a call cut off by its time limit
# still returns the parts it finished). Figures of one part come from one process.
#
#   .venv-oldest/bin/python scripts/device_wheels.py .tpu-wheels   # here
#   OUT=/tmp/out bash scripts/device_run.sh mem fused88 ingraph88   # there
#
# Parts (minutes on a TPU v5e, 2026-12-08, start-up not counted):
#   mem        what memory_stats() reports, and a transfer's own device memory (0.3)
#   fused88    the model step, fused, chip 88% full, long step, Orbax beside (4)
#   split88    the same, split (gradient, then update) (3)
#   ingraph88  InGraphStep alone on the fused step, 88% full (2)
#   short88    every kind on the short step (one microbatch), 88% full (2)
#   room       every kind with room for a copy, long step (5)
#   restore    a save, then four restores each in a new process (2)
#   probes     bench/probe_snapshot_cost.py: each kind's step split in parts (6)
# Host memory: under gVisor the machine's available memory fell about 0.6 GB per
# 1.6 GB snapshot taken and freed (2026-12-07); a part with a hundred snapshots can
# run a 40 GiB host out (the probe stops a case below 8 GB available).
set -u
OUT=${OUT:?set OUT to the folder that comes back}
WHEELS=${WHEELS:-.tpu-wheels}
python3 -m pip install --isolated --no-index --no-deps --target /tmp/site -q "$WHEELS"/*.whl \
  > "$OUT/pip.log" 2>&1
export PYTHONPATH=${PYTHONPATH:-}:/tmp/site
python3 -c "import jax; print(jax.__version__, jax.devices())" > "$OUT/jax.txt" 2>&1
model() {  # model NAME ARGS...: bench/accelerator.py's model step alone
  local name=$1; shift
  python3 bench/accelerator.py --only-model --model-steps 12 "$@" > "$OUT/$name.json" \
    2> "$OUT/$name.log"
}
for part in "$@"; do
  date -u +"%H:%M:%S start $part" >> "$OUT/times.txt"
  case $part in
    mem) python3 bench/probe_transfer_memory.py > "$OUT/mem.json" 2> "$OUT/mem.log" ;;
    fused88) model fused88 --fills 0.88 --no-room --lengths long --kinds fused ;;
    split88) model split88 --fills 0.88 --no-room --lengths long --kinds split ;;
    ingraph88) model ingraph88 --fills 0.88 --no-room --lengths long --kinds in_graph ;;
    short88) model short88 --fills 0.88 --no-room --lengths short ;;
    room) model room --fills --lengths long ;;
    restore) rm -rf /dev/shm/mtc-rf && python3 bench/restore_fresh.py save /dev/shm/mtc-rf \
               > "$OUT/restore.log" 2>&1 &&
             for _ in 1 2 3 4; do
               python3 bench/restore_fresh.py restore /dev/shm/mtc-rf >> "$OUT/restore.jsonl" \
                 2>> "$OUT/restore.log"
             done
             rm -rf /dev/shm/mtc-rf ;;
    probes) for kind in fused split in_graph; do
              python3 bench/probe_snapshot_cost.py --kind "$kind" --cases plain snap_paced \
                > "$OUT/probe-$kind.json" 2>> "$OUT/probes.log"
            done ;;
    *) echo "unknown part: $part" >> "$OUT/times.txt" ;;
  esac
  date -u +"%H:%M:%S end $part rc=$?" >> "$OUT/times.txt"
done

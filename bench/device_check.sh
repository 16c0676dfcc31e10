#!/usr/bin/env bash
# The one real cross-device check we can make: PI0 small on CUDA against the same run on the CPU.
#
#   bash bench/device_check.sh [WORK]      (default WORK: dumps/device-check)
#
# On a machine with CUDA: makes sure pi0align is installed (./.venv from scripts/install.sh, or the
# python in $PYTHON with wheels carried in .whl/ installed offline), runs the small preset on cuda
# and on cpu with tensor dumps of steps 0 and 1, in fp32 and then bf16, compares each pair (A = cpu,
# B = cuda) and prints the verdicts, the culprit groups and both runs' images/sec. cuDNN runs fp32
# convolutions on TF32 by default (torch.backends.cudnn.allow_tf32), and SigLIP's patch embedding
# is a convolution: the compare's notes say so. Then the scale and tuning checks: two runs of 2
# processes over NCCL compared rank by rank (with 2 GPUs or more; NCCL takes one device a rank),
# the dump's overhead on cuda (bench/dump_overhead.py), and fused AdamW on and off, with a fused
# run compared against an unfused one (bench/tuning.py). Exit: 0 when it ran, 2 when it cannot run here.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-dumps/device-check}
if [ -x .venv/bin/python ]; then
    py=.venv/bin/python
else
    py=${PYTHON:-python3}
    if [ -d .whl ]; then  # no registry on the device machine: the wheels travel with the tree
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site:$(pwd)${PYTHONPATH:+:$PYTHONPATH}
    elif ! "$py" -c "import pi0align.cli.main" 2>/dev/null; then
        bash scripts/install.sh
        py=.venv/bin/python
    fi
fi
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "device_check: no CUDA device here" >&2
    exit 2
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
"$py" -c "import torch; print('device:', torch.cuda.get_device_name(0), '· torch', torch.__version__)"
for dtype in fp32 bf16; do
    for device in cpu cuda; do
        out="$work/$dtype-$device"
        rm -rf "$out"
        "$py" -m pi0align.cli.main run --device "$device" --dtype "$dtype" --preset small --steps 2 \
            --dump-steps 0,1 --dump-mode tensor --threads 8 --out "$out" --no-progress --log-every 0 \
            | sed "s/^/[$dtype $device] /"
    done
    "$py" -m pi0align.cli.main compare "$work/$dtype-cpu" "$work/$dtype-cuda" --no-html --top 5 \
        --json "$work/$dtype.json" | sed "s/^/[$dtype compare] /" || true
done
"$py" - "$work" <<'PY'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
for dtype in ("fp32", "bf16"):
    summary = json.loads((work / f"{dtype}.json").read_text())
    speeds = {d: json.loads((work / f"{dtype}-{d}" / "summary.json").read_text())["images_per_sec"] for d in ("cpu", "cuda")}
    first = summary["first_divergence"]
    print(f"{dtype}: {summary['verdict']} (noise model {summary['noise_model']}, "
          f"{summary['rows_over_dtype_limits']} rows beyond the dtype limits), {len(summary['culprits'])} culprits; "
          f"images/sec cpu {speeds['cpu']:.1f}, cuda {speeds['cuda']:.1f}")
    if first:
        print(f"    first divergence: {first['kind']} {first['name']} ({first['direction']}, step {first['step']})")
    for group in summary["culprit_groups"][:8]:
        print(f"    {group['count']:4d} × {group['kind']} {group['api']} "
              f"({group['share_introducing']:.0%} of {group['calls']} calls introduce error) {group['hint']}")
    for note in summary["notes"]:
        print(f"    note: {note}")
PY

gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
    for run in a b; do
        "$py" -m pi0align.cli.main run --device cuda --nproc 2 --preset small --steps 3 --dump-steps 0,1 \
            --out "$work/nccl-$run" --no-progress --log-every 0 | sed "s/^/[nccl $run] /"
    done
    "$py" -m pi0align.cli.main compare "$work/nccl-a" "$work/nccl-b" --no-html --top 3 | sed "s/^/[nccl compare] /" || true
else
    echo "[nccl] skipped: $gpus GPU here, and NCCL takes one device a rank"
fi
"$py" bench/dump_overhead.py --device cuda --skip-msprobe --rounds 3 | sed "s/^/[dump overhead cuda] /"
"$py" bench/tuning.py --device cuda --preset small --steps 20 --switches fused | sed "s/^/[tuning cuda] /"
for optimizer in adamw adamw-fused; do
    "$py" -m pi0align.cli.main run --device cuda --preset small --steps 2 --dump-steps 0,1 --optimizer "$optimizer" \
        --out "$work/$optimizer" --no-progress --log-every 0 >/dev/null
done
"$py" -m pi0align.cli.main compare "$work/adamw" "$work/adamw-fused" --no-html --top 3 | sed "s/^/[fused compare] /" || true

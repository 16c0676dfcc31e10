#!/usr/bin/env bash
# The one real cross-device check within reach: PI0 small on CUDA against the same run on the CPU,
# ordered so that the first minutes answer what matters most, each answer printed as it exists.
#
#   bash bench/device_check.sh [--quick] [--install-only] [WORK]      (default WORK: dumps/device-check)
#
# 1. fp32, then bf16: PI0 small on cpu and cuda, tensor dumps of steps 0 and 1, compared (A = cpu,
#    B = cuda): verdict, noise model, culprit groups (cuDNN runs fp32 convolutions on TF32 by
#    default, and SigLIP's patch embedding is one: its group should say so), images/sec.
# 2. a gelu of the action expert 2 % off on the cuda side (pushed in by testing/device_site): found?
# 3. the dump's overhead on cuda (bench/dump_overhead.py: the torch backend, stats and mix), the
#    monitor's (bench/monitor_overhead.py), fused AdamW on and off (bench/tuning.py, and a fused run
#    compared with an unfused one); two runs of 2 processes over NCCL where there are 2 GPUs.
# --quick (a second try): fp32 only, the fault, one round of each overhead.
#
# Where the image lacks pi0align's dependencies and reaches no registry (the GPU machine), the
# wheels travel with the tree (.whl/wheels.tar.xz, from scripts/device_wheels.sh) and are installed
# offline (--no-index) over the image's own torch; --install-only stops there (how that install is
# proven without a GPU: CONTRIBUTING.md). Exit: 0 when it ran, 2 when it cannot run here.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0 install_only=0
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) quick=1; shift ;;
        --install-only) install_only=1; shift ;;
        *) break ;;
    esac
done
work=${1:-dumps/device-check}
started=$SECONDS
say() { echo "[$(( SECONDS - started ))s] $*"; }

if [ -x .venv/bin/python ]; then
    py=.venv/bin/python
else
    py=${PYTHON:-python3}
    if [ -f .whl/wheels.tar.xz ]; then  # no registry here: the wheels came with the tree
        site=${PI0ALIGN_SITE:-/tmp/pi0align-site}
        unpacked=$(mktemp -d)
        "$py" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
            .whl/wheels.tar.xz "$unpacked"
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$unpacked"/*.whl
        rm -rf "$unpacked"
        export PYTHONPATH=$site:$(pwd)${PYTHONPATH:+:$PYTHONPATH}
        say "installed $(ls "$site" | grep -c dist-info) wheels offline into $site"
    elif ! "$py" -c "import pi0align.cli.main" 2>/dev/null; then
        bash scripts/install.sh
        py=.venv/bin/python
    fi
fi
"$py" -c "import pi0align, torch, transformers, lerobot; print('pi0align', pi0align.__version__, '· torch', \
torch.__version__, '· transformers', transformers.__version__, '· lerobot', lerobot.__version__)"
[ "$install_only" = 1 ] && exit 0
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "device_check: no CUDA device here" >&2
    exit 2
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
say "device: $("$py" -c "import torch; print(torch.cuda.get_device_name(0))")"
pi0() { "$py" -m pi0align.cli.main "$@"; }
RUN=(run --preset small --steps 2 --dump-steps 0,1 --dump-mode tensor --threads 8 --no-progress --log-every 0)

summary() {  # the compare's JSON, in a few lines
    "$py" - "$1" "$2" <<'PY'
import json, sys
from pathlib import Path
summary, folders = json.loads(Path(sys.argv[1]).read_text()), sys.argv[2].split(",")
speeds = [json.loads((Path(f) / "summary.json").read_text())["images_per_sec"] for f in folders]
print(f"{summary['verdict']} (noise model {summary['noise_model']}, {summary['rows_over_dtype_limits']} rows beyond "
      f"the dtype limits), {len(summary['culprits'])} culprits; images/sec A {speeds[0]:.1f}, B {speeds[1]:.1f}")
if summary["first_divergence"]:
    first = summary["first_divergence"]
    print(f"  first divergence: {first['kind']} {first['name']} ({first['direction']}, step {first['step']})")
for culprit in summary["culprits"][:3]:
    print(f"  culprit: {culprit['name']} ({culprit['kind']}, {culprit['direction']})")
for group in summary["culprit_groups"][:6]:
    print(f"  {group['count']:4d} × {group['kind']} {group['api']} ({group['share_introducing']:.0%} of "
          f"{group['calls']} calls introduce error) {group['hint']}")
for note in summary["notes"]:
    print(f"  note: {note}")
PY
}

dtypes=(fp32 bf16)
[ "$quick" = 1 ] && dtypes=(fp32)
for dtype in "${dtypes[@]}"; do
    for device in cpu cuda; do
        rm -rf "$work/$dtype-$device"
        pi0 "${RUN[@]}" --device "$device" --dtype "$dtype" --out "$work/$dtype-$device" >/dev/null
    done
    pi0 compare "$work/$dtype-cpu" "$work/$dtype-cuda" --no-html --top 5 --json "$work/$dtype.json" >/dev/null || true
    say "$dtype cpu against cuda: $(summary "$work/$dtype.json" "$work/$dtype-cpu,$work/$dtype-cuda")"
done

fault='{"module": "model.paligemma_with_expert.gemma_expert.model.layers.1.mlp", "function": "gelu", "factor": 1.02}'
rm -rf "$work/fp32-cuda-gelu"
PYTHONPATH=$(pwd)/pi0align/testing/device_site${PYTHONPATH:+:$PYTHONPATH} PI0ALIGN_EMULATED_DEVICE=$fault \
    pi0 "${RUN[@]}" --device cuda --dtype fp32 --out "$work/fp32-cuda-gelu" >/dev/null
pi0 compare "$work/fp32-cpu" "$work/fp32-cuda-gelu" --no-html --top 5 --json "$work/gelu.json" >/dev/null || true
say "fp32 cpu against cuda with the expert's layer-1 gelu 2 % off: $(summary "$work/gelu.json" \
    "$work/fp32-cpu,$work/fp32-cuda-gelu")"

rounds=3
[ "$quick" = 1 ] && rounds=1
"$py" bench/dump_overhead.py --device cuda --skip-msprobe --rounds "$rounds" | sed "s/^/[dump overhead cuda] /"
say "dump overhead measured"
"$py" bench/monitor_overhead.py --device cuda --rounds "$rounds" | sed "s/^/[monitor overhead cuda] /"
say "monitor overhead measured"
[ "$quick" = 1 ] && exit 0

"$py" bench/tuning.py --device cuda --preset small --steps 20 --switches fused | sed "s/^/[tuning cuda] /"
for optimizer in adamw adamw-fused; do
    pi0 run --device cuda --preset small --steps 2 --dump-steps 0,1 --optimizer "$optimizer" \
        --out "$work/$optimizer" --no-progress --log-every 0 >/dev/null
done
pi0 compare "$work/adamw" "$work/adamw-fused" --no-html --top 3 --json "$work/fused.json" >/dev/null || true
say "unfused against fused AdamW: $(summary "$work/fused.json" "$work/adamw,$work/adamw-fused")"
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
    for run in a b; do
        pi0 run --device cuda --nproc 2 --preset small --steps 3 --dump-steps 0,1 --out "$work/nccl-$run" \
            --no-progress --log-every 0 >/dev/null
    done
    pi0 compare "$work/nccl-a" "$work/nccl-b" --no-html --top 3 | sed "s/^/[nccl compare] /" || true
else
    say "nccl skipped: $gpus GPU here, and NCCL takes one device a rank"
fi
say "done"

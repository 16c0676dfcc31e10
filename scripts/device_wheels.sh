#!/usr/bin/env bash
# The wheels the GPU machine's image lacks, fetched here for its Python and platform, to travel with
# the tree (the device machine reaches no registry): DIR/wheels.tar.xz, which bench/device_check.sh
# unpacks there and installs with `pip install --no-index --no-deps --target` over the image's own
# torch.
#
#   bash scripts/device_wheels.sh [DIR]      (default DIR: .whl, ignored by git; carry it)
#
# The image (as issue 56 describes it): Python 3.12, torch 2.11 (cu130), torchvision 0.26,
# transformers 5.17, tokenizers 0.23, accelerate 1.15, numpy 2.5, safetensors, h5py, pandas, rich,
# jinja2, einops, tensorboard, pytest, hypothesis. Below: what `pi0align run`, the dump and compare
# import beyond it, each wheel without its dependencies (the closure, found by running PI0 tiny in a
# clean venv of the image's packages with nothing else: CONTRIBUTING.md). Not carried: plotly (the
# HTML report; the device check writes none).
#
# 64 MiB travel with the tree, and pyarrow, av and hdf5plugin alone are 140 MB of wheels. So the
# wheels travel uncompressed inside one xz archive (xz finds what zip's deflate cannot), and two
# are slimmed, their RECORD rewritten to match: pyarrow without Flight, S3, its C++ headers, Cython
# sources and tests, and the link-time copies of its Python libraries (`datasets` reads local
# Parquet: none of these; pyarrow.lib links Substrait, which stays), hdf5plugin with its Zstandard
# filter only (the one the dump writes). Prints the sizes; fails past 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
python=${PYTHON:-python3}
mkdir -p "$dir"
download=$(mktemp -d)
trap 'rm -rf "$download"' EXIT
WHEELS=(
    # LeRobot, and what its modules import on the way to PI0, its dataset and its processors
    lerobot==0.4.4 draccus==0.10.0 mergedeep==1.3.4 pyyaml-include==1.4.1 toml==0.10.2 typing-inspect==0.9.0
    mypy-extensions==1.2.0 jsonlines==4.0.0 termcolor==3.3.0 deepdiff==9.1.0 orderly-set==5.5.0
    cachebox==5.2.3 imageio==2.38.1 diffusers==0.35.2 pyserial==3.5 av==15.1.0
    datasets==4.8.5 pyarrow==26.0.1 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 requests==2.34.2
    urllib3==2.8.0 charset-normalizer==3.5.3
    # the transformers (and its Hub client and tokenizers) our compatibility layer is written for
    transformers==4.57.6 huggingface-hub==0.35.3 tokenizers==0.22.2
    # the dump file's codecs
    hdf5plugin==7.1.0 zstandard==0.25.0 orjson==3.13.0
)
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$download" "${WHEELS[@]}"
"$python" - "$download" <<'PY'
"""Every wheel rewritten stored (uncompressed); pyarrow's and hdf5plugin's slimmed, RECORD to match."""
import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path

DROP = {"pyarrow": re.compile(r"pyarrow/(include|tests|src)/|pyarrow/.*\.(pyx|pxd|pxi)$"  # C++ and Cython sources
                              r"|pyarrow/(lib)?_?(arrow_)?(python_)?(flight|s3)"  # Flight and S3: not imported
                              r"|pyarrow/libarrow_python\w*\.so(\.\d+\.\d+\.\d+)?$"),  # copies of each .so.2600
        "hdf5plugin": re.compile(r"hdf5plugin/plugins/libh5(?!zstd)")}
EDIT = {"hdf5plugin/_config.py": (re.compile(r"'embedded_filters': \([^)]*\)"), "'embedded_filters': ('zstd',)")}


def record_line(name: str, data: bytes) -> bytes:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n".encode()


for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    drop = DROP.get(wheel.name.split("-")[0])
    with zipfile.ZipFile(wheel) as source:
        entries = {info.filename: (info, source.read(info)) for info in source.infolist()
                   if drop is None or not drop.match(info.filename)}
    for name, (pattern, replacement) in EDIT.items():
        if name in entries:
            info, data = entries[name]
            entries[name] = (info, pattern.sub(replacement, data.decode()).encode())
    record = next(name for name in entries if name.endswith(".dist-info/RECORD"))
    entries[record] = (entries[record][0], b"".join(
        record_line(name, data) for name, (_, data) in entries.items() if name != record) + f"{record},,\n".encode())
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as target:
        for info, data in entries.values():
            target.writestr(info, data, compress_type=zipfile.ZIP_STORED)
PY
tar -cf - -C "$download" . | xz -9 -T0 > "$dir/wheels.tar.xz"
wheels=$(stat -c %s "$dir/wheels.tar.xz")
tree=$(git archive HEAD | wc -c)
total=$((wheels + tree))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "device_wheels: $(ls "$download" | wc -l) wheels in $dir/wheels.tar.xz: $(mib "$wheels") + the tree $(mib "$tree") = $(mib "$total") (the limit: 64 MiB)"
[ "$total" -le $((64 * 1048576)) ] || { echo "device_wheels: over 64 MiB" >&2; exit 1; }

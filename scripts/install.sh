#!/usr/bin/env bash
# Install pi0align and everything it needs into ./.venv, at the versions in constraints.txt.
# Repeatable on a fresh machine; touches no Hugging Face Hub.
#   scripts/install.sh          the tool (training, dumping, comparing, reports)
#   scripts/install.sh scale    + DeepSpeed (run --engine deepspeed)
#   scripts/install.sh test     + DeepSpeed, the test tools and Debian's Chromium for the browser tests
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
pip() { .venv/bin/python -m pip "$@"; }

[ -x .venv/bin/python ] || "$python" -m venv .venv
pip install -q --upgrade "pip>=24"
# torch and torchvision as a matched pair, first, so nothing below can pull another torch.
pip install -q -c constraints.txt torch torchvision
extras=msprobe,notebooks,tensorboard
[ "${1:-}" = scale ] && extras="msprobe,notebooks,tensorboard,scale"
[ "${1:-}" = test ] && extras="msprobe,notebooks,tensorboard,scale,test"
pip install -q -c constraints.txt -e ".[${extras}]"
# LeRobot pins torch<2.11, which excludes the torch here: its real needs are in pyproject.toml.
pip install -q -c constraints.txt --no-deps lerobot
if [ "${1:-}" = test ] && ! command -v chromium >/dev/null; then
    # Debian's Chromium for the HTML report's browser test (playwright must not download one).
    (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "install.sh: could not install chromium" >&2
fi
# The native code, built now rather than at the first dumped run or compare (about 20 s; cached
# under $PI0ALIGN_CACHE, else ~/.cache/pi0align): the dump's C++ extension and kernel, compare's
# loops and its msprobe JSON scanner. Without a compiler each falls back to its Python path.
.venv/bin/python -c "from pi0align.dump.backends.backend import choose_backend; b = choose_backend('auto'); print('dump backend:', b.name, '-', b.status)"
.venv/bin/python -c "from pi0align.compare.measuring.kernels import comparison_loops; from pi0align.compare.reading.msprobe_scan import scanner; print('compare loops:', comparison_loops().status, '- msprobe scanner:', 'compiled' if scanner() else 'none (Python reads msprobe JSON)')"
echo "pi0align installed in $(pwd)/.venv"

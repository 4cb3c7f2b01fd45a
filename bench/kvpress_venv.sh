#!/usr/bin/env bash
# Builds .venv-kvpress: NVIDIA's kvpress 0.5.5 (PyPI) on the CPU torch, for bench/kvpress_parity.py's peer side.
# Not part of CI. A venv of its own because kvpress 0.5.5 requires transformers <5.3 while learnkv runs on newer
# ones; nothing of learnkv is installed into it (the parity bench hands the worker the model folder and token ids).
#
#     bash bench/kvpress_venv.sh            # ~1.5 GB, a few minutes; idempotent
#     python bench/kvpress_parity.py        # then the side-by-side benchmark (see its docstring)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
VENV=${KVPRESS_VENV:-.venv-kvpress}

python3 -m venv "$VENV"
# torch first, the local CPU wheel that constraints-cpu.txt pins (otherwise pip resolves the CUDA build from PyPI)
"$VENV/bin/pip" install -q -c constraints-cpu.txt torch==2.13.0
"$VENV/bin/pip" install -q -c constraints-cpu.txt kvpress==0.5.5
# fail here, loudly, rather than in the benchmark's first round
"$VENV/bin/python" -c "import torch, transformers, kvpress; from kvpress import DecodingPress, KnormPress
print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5', 'torch', torch.__version__,
      'transformers', transformers.__version__)"

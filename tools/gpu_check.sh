#!/usr/bin/env bash
# The GPU check (tools/gpu_check.py) with the checkout on PYTHONPATH and nothing installed:
#   bash tools/gpu_check.sh [--device cpu --quick] [--commit HASH] [--output FILE] ...
#   PYTHON=/path/to/python bash tools/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m tools.gpu_check "$@"

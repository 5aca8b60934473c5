#!/usr/bin/env bash
# The main job: install, then a real 2-rank torchrun training run of the demo GPT with distmon
# serving Prometheus metrics (http://127.0.0.1:9290/metrics, rank 0) on its defaults.
#   bash launch/demo.sh [train.py flags...]      e.g.  bash launch/demo.sh --steps 500
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
exec bash launch/torchrun_single_node.sh "$@"

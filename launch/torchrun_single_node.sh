#!/usr/bin/env bash
# Single-node launch of the distmon demo trainer (launch/train.py) under torchrun.
#
# Usage:
#   launch/torchrun_single_node.sh [train.py flags...]
#   NPROC=8 launch/torchrun_single_node.sh --preset 20m --steps 1000
#   NPROC=2 launch/torchrun_single_node.sh --nan-step 120 --nan-rank 1
#
# Environment:
#   NPROC         processes on this node (default: number of GPUs, or 2 without GPUs)
#   MAX_RESTARTS  torchrun --max-restarts (default 0): restart every worker when one fails, e.g.
#                 MAX_RESTARTS=3 launch/torchrun_single_node.sh --checkpoint-dir ckpt
#   DISTMON_*     monitor settings read by distmon (DISTMON_SERVE, DISTMON_PORT, DISTMON_ADDR,
#                 DISTMON_RUN_ID, DISTMON_LOG_PATH, DISTMON_FILE_SD_DIR, DISTMON_LINGER_S, ...)
#
# --standalone runs a private c10d rendezvous on a free local port, so several jobs can
# share the machine. Metrics are served by rank 0 (this node's first rank) on 127.0.0.1:9290
# unless configured; a second job on the machine takes the next free port (port_fallback).
#
# Restarts need the c10d rendezvous (--standalone is one) and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
# set here: with torch's shared store (pytorch/pytorch#135712), or with the static rendezvous
# (--master-port), restarted workers can be handed the previous attempt's addresses and fail
# ("Gloo connectFullMesh failed ... Connection refused") or hang: docs/deployment.md#torchrun-restarts.
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

if [[ -z "${NPROC:-}" ]]; then
    NPROC=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        NPROC="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    fi
    if [[ "${NPROC}" -lt 1 ]]; then
        NPROC=2
    fi
fi

export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
exec torchrun --standalone --nproc-per-node "${NPROC}" --max-restarts "${MAX_RESTARTS:-0}" \
    "${script_dir}/train.py" "$@"

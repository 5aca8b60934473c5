#!/usr/bin/env bash
# Multi-node launch of the distmon demo trainer with torchrun's c10d rendezvous.
# Run this once on every node, with the same NNODES, RDZV_ENDPOINT and RUN_ID everywhere.
#
# Usage (two nodes, 8 GPUs each; node0 hosts the rendezvous):
#   node0$ NNODES=2 NODE_RANK=0 RDZV_ENDPOINT=node0:29400 RUN_ID=exp42 NPROC=8 \
#              launch/torchrun_multi_node.sh --preset 20m --steps 2000
#   node1$ NNODES=2 NODE_RANK=1 RDZV_ENDPOINT=node0:29400 RUN_ID=exp42 NPROC=8 \
#              launch/torchrun_multi_node.sh --preset 20m --steps 2000
#
# Environment:
#   NNODES         number of nodes, or MIN:MAX for an elastic job (required)
#   RDZV_ENDPOINT  host:port of the c10d rendezvous store (required); the host should be
#                  one of the nodes (the one with NODE_RANK=0)
#   RUN_ID         job id shared by all nodes: the rendezvous id and distmon's run_id
#                  (required; default: SLURM_JOB_ID when run under Slurm)
#   NODE_RANK      optional; with c10d the ranks are assigned by the rendezvous, so it is
#                  only used to say which node hosts the store (NODE_RANK=0 -> is_host).
#                  Defaults to SLURM_NODEID under srun. Unset: torchrun decides by hostname.
#   NPROC          processes per node (default: number of GPUs, or 1 without GPUs)
#   MAX_RESTARTS   torchrun --max-restarts (default 0); restarts use the c10d rendezvous below and
#                  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (set here, as the restarted workers need it:
#                  docs/deployment.md#torchrun-restarts)
#
# distmon settings exported here (override by setting them before calling):
#   DISTMON_RUN_ID=$RUN_ID  DISTMON_SERVE=node (local rank 0 of each node serves its node's
#   ranks)  DISTMON_ADDR=0.0.0.0 (reachable by Prometheus from other hosts)
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

: "${NNODES:?set NNODES to the number of nodes (or MIN:MAX)}"
: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT to host:port of the rendezvous (on the first node)}"
RUN_ID="${RUN_ID:-${SLURM_JOB_ID:-}}"
: "${RUN_ID:?set RUN_ID to an id shared by all nodes of this job}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-}}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"

if [[ -z "${NPROC:-}" ]]; then
    NPROC=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        NPROC="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    fi
    if [[ "${NPROC}" -lt 1 ]]; then
        NPROC=1
    fi
fi

# torch's shared rendezvous store hands restarted workers their predecessors' addresses
# (pytorch/pytorch#135712): each attempt's rank 0 hosts a store of its own instead
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
export DISTMON_RUN_ID="${DISTMON_RUN_ID:-${RUN_ID}}"
export DISTMON_SERVE="${DISTMON_SERVE:-node}"
export DISTMON_ADDR="${DISTMON_ADDR:-0.0.0.0}"

rdzv_conf=()
if [[ -n "${NODE_RANK}" ]]; then
    if [[ "${NODE_RANK}" == "0" ]]; then
        rdzv_conf=(--rdzv-conf is_host=true)
    else
        rdzv_conf=(--rdzv-conf is_host=false)
    fi
fi

exec torchrun \
    --nnodes "${NNODES}" \
    --nproc-per-node "${NPROC}" \
    --rdzv-backend c10d \
    --rdzv-endpoint "${RDZV_ENDPOINT}" \
    --rdzv-id "${RUN_ID}" \
    "${rdzv_conf[@]}" \
    --max-restarts "${MAX_RESTARTS}" \
    "${script_dir}/train.py" "$@"

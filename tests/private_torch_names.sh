#!/usr/bin/env bash
# Which of the private torch names distmon/compat.py uses each torch release lacks: a grep of the
# release's own sources (and, for the callables, a look-up), over the venvs the CI tiers cache
# (tests/torch_env.py). compat.py's notes ("checked on 2.6-2.14") come from this; a name missing
# on a release must be one whose note names the release that added it (a fallback).
#   bash tests/private_torch_names.sh                      # 2.6.0 ... 2.14.1
#   VERSIONS="2.9.1 2.15.0" bash tests/private_torch_names.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PINNED=$(sed -n 's/^PIN=torch==//p' launch/install.sh)
for v in ${VERSIONS:-2.6.0 2.7.1 2.8.0 2.9.1 2.10.0 2.11.0 2.12.1 $PINNED 2.14.1}; do
  if [ "$v" = "$PINNED" ]; then py=python3; else py=$(python3 tests/torch_env.py "$v") || continue; fi
  d=$($py -c 'import importlib.util as u; print(u.find_spec("torch").submodule_search_locations[0])')
  miss=""
  chk() { grep -q -- "$2" "$d/$1" 2>/dev/null || miss="$miss $2@$1"; }
  chk _dynamo/config.py "compiled_autograd"
  chk _dynamo/compiled_autograd.py "compiled_autograd_enabled"
  chk _dynamo/compiled_autograd.py "in_compiled_autograd_region"
  chk _dynamo/eval_frame.py "_orig_mod"
  chk distributed/algorithms/_checkpoint/checkpoint_wrapper.py "_checkpoint_wrapped_module"
  chk distributed/fsdp/_common_utils.py "_fsdp_wrapped_module"
  chk distributed/tensor/_api.py "_spec"
  chk distributed/tensor/_api.py "_local_tensor"
  chk distributed/tensor/parallel/ddp.py "_st_info"
  chk optim/optimizer.py "_optimizer_step_pre_hooks"
  chk amp/grad_scaler.py "_per_optimizer_states"
  chk distributed/pipelining/stage.py "class _PipelineStageBase"
  chk nn/parallel/distributed.py "def _find_tensors"
  chk nn/parallel/distributed.py "self._module_parameters"
  chk nn/parallel/distributed.py "self._comm_hooks"
  chk distributed/distributed_c10d.py "def _get_default_store"
  chk nn/parallel/distributed.py "_delay_all_reduce_all_params"
  chk nn/parallel/distributed.py "_use_python_reducer"
  chk distributed/fsdp/_fully_shard/_fsdp_param_group.py "self._reduce_scatter_comm"
  chk distributed/fsdp/_fully_shard/_fsdp_param_group.py "def _reduce_scatter_process_group"
  chk distributed/fsdp/_fully_shard/_fsdp_param_group.py "def _all_reduce_process_group"
  chk distributed/fsdp/_fully_shard/_fsdp_param_group.py "def post_backward"
  chk distributed/fsdp/_fully_shard/_fsdp_param.py "_unsharded_param"
  chk distributed/fsdp/_fully_shard/_fully_shard.py "def _get_fsdp_state"
  chk distributed/fsdp/_fully_shard/_fsdp_collectives.py "def _get_gradient_divide_factors"
  chk distributed/device_mesh.py "_mesh_resources"
  chk distributed/device_mesh.py "def _get_root_mesh"
  chk distributed/fsdp/_fully_shard/_fsdp_state.py "_fsdp_param_groups"
  chk distributed/fsdp/_fully_shard/_fsdp_api.py "class ReduceScatter"
  calls=$($py -c '
import torch
names = ["torch.autograd.Variable._execution_engine.queue_callback", "torch._C._current_graph_task_id",
         "torch._C._autograd._profiler_enabled", "torch._foreach_mul_", "torch._foreach_copy_",
         "torch._foreach_sub_", "torch._foreach_norm", "torch._foreach_powsum"]
missing = []
for n in names:
    try:
        eval(n)
    except AttributeError:
        missing.append(n)
print(" ".join(missing))' 2>/dev/null)
  echo "torch $v lacks:${miss:- nothing} ${calls}"
done

#!/usr/bin/env bash
# distmon on older torch releases, beside the pinned suite of tests/run.sh (issue #34). Per tier:
# the fast tier, then the release tests' real 2-rank DDP and FSDP2 jobs and a world of one
# (tests/test_torch_versions.py) and one N-D parity job (TP + FSDP2), against float64.
#   bash tests/run_torch_tiers.sh                 # every tier
#   TIERS=2.9.1 bash tests/run_torch_tiers.sh     # one (any release from 2.6 on)
# Each tier's torch is a venv under ~/.cache/distmon-ci (tests/torch_env.py: the wheel alone,
# downloaded once, with stubs for the CUDA libraries a CPU never calls); the system Python's
# torch is left as it is. Under CI=true a tier that cannot be installed fails the run; elsewhere
# it is skipped, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
TIERS=${TIERS:-2.9.1 2.11.0}
# the release tests' real jobs (DDP, FSDP2, a world of one) and every check of the TP + FSDP2 layout
JOBS=(-m slow tests/test_torch_versions.py tests/test_layouts.py -k "test_torch_versions or (tp_fsdp and not bf16 and not pp_)")
failed=0
for version in $TIERS; do
  start=$SECONDS
  if ! py=$(python3 tests/torch_env.py "$version"); then
    if [ "${CI:-}" = true ]; then
      echo "[tiers] torch $version cannot be installed: failing (CI=true)" >&2
      exit 1
    fi
    echo "[tiers] torch $version cannot be installed: skipped" >&2
    continue
  fi
  echo "[tiers] torch $version ($py): fast tier, then the parity jobs"
  "$py" -m pytest -q -p no:cacheprovider -m 'not slow' || failed=1
  "$py" -m pytest -q -p no:cacheprovider "${JOBS[@]}" || failed=1
  echo "[tiers] torch $version: $((SECONDS - start)) s"
done
exit $failed

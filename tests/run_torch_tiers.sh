#!/usr/bin/env bash
# distmon on other torch releases, beside the pinned suite of tests/run.sh (issues #34, #31). Per
# tier, the fast tier (the tiers' side by side), then:
# - on the older releases (2.9.1, 2.11.0: the complete floor and the GPU image's torch), the release
#   tests' real 2-rank DDP and FSDP2 jobs and a world of one (tests/test_torch_versions.py) and one
#   N-D parity job (TP + FSDP2), against float64;
# - on the newest release that installs here (2.14.1), the FSDP2 tests, the layout tests and the
#   framework tests (Lightning, HF Trainer/accelerate, Fabric) and the precursor on real HF models.
#   bash tests/run_torch_tiers.sh                 # every tier
#   TIERS=2.9.1 bash tests/run_torch_tiers.sh     # one (any release from 2.6 on: the older jobs)
# Each tier's torch is a venv under ~/.cache/distmon-ci (tests/torch_env.py: the wheel alone,
# downloaded once, with stubs for the CUDA libraries a CPU never calls; the frameworks are the
# system Python's, seen through --system-site-packages); the system Python's torch is left as it
# is. Under CI=true a tier that cannot be installed fails the run; elsewhere it is skipped, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
TIERS=${TIERS:-2.9.1 2.11.0 2.14.1}
NEWEST=2.14.1  # the newest release that installs here: the FSDP2, layout and framework tests too
# the release tests' real jobs (DDP, FSDP2, a world of one) and every check of the TP + FSDP2 layout
OLDER=(-m slow tests/test_torch_versions.py tests/test_layouts.py -k "test_torch_versions or (tp_fsdp and not bf16 and not pp_)")
# the newest: FSDP2's tests, every layout's and the frameworks'
NEWER=(-m slow tests/test_fsdp.py tests/test_layouts.py
  tests/test_framework_lightning.py tests/test_framework_hf.py tests/test_framework_fabric.py
  tests/test_precursor_models.py)
# The fast tier less the modules that never reach torch (Prometheus rules through promtool, the
# deploy manifests, the docs site, the report and the HTTP server, the last two tested to import no
# torch, the collective-scaling model, the test suite's own shape): they cannot differ between
# torch releases and run once, in the pinned suite. Also left out: the detectors' and the cross-rank reductions' long
# generated series (elementwise tensor math only, the slowest fast modules); they run once, in
# the pinned suite; the parity jobs (test_torch_versions) compare real jobs' snapshots
# across the releases. The docs' drift checks too: a page names torch's functions as the pinned
# release has them (`torch._foreach_powsum` from 2.11 on, which the page says).
TORCHLESS=(--ignore=tests/test_alert_rules.py --ignore=tests/test_deploy_manifests.py
  --ignore=tests/test_docs.py --ignore=tests/test_doc_drift.py
  --ignore=tests/test_report.py --ignore=tests/test_http_server.py
  --ignore=tests/test_collective_model.py --ignore=tests/test_suite_shape.py
  --ignore=tests/test_detectors_unit.py --ignore=tests/test_crossrank.py)
# The fast tiers run side by side (each is one in-process pytest, ~1 core: on CI's 2 cores the
# three take ~1.5x one's time instead of 3x), each in a temporary folder of its own; the parity
# jobs (2-4 ranks each) one after another.
declare -A pys
for version in $TIERS; do
  if ! pys[$version]=$(python3 tests/torch_env.py "$version"); then
    if [ "${CI:-}" = true ]; then
      echo "[tiers] torch $version cannot be installed: failing (CI=true)" >&2
      exit 1
    fi
    echo "[tiers] torch $version cannot be installed: skipped" >&2
    unset "pys[$version]"
  fi
done
[ ${#pys[@]} -gt 0 ] || exit 0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0
start=$SECONDS
for version in "${!pys[@]}"; do
  mkdir "$work/$version"
  "${pys[$version]}" -m pytest -q -p no:cacheprovider --basetemp="$work/$version/tmp" -m 'not slow' "${TORCHLESS[@]}" \
    >"$work/$version/log" 2>&1 &
  echo $! >"$work/$version/pid"
done
for version in "${!pys[@]}"; do
  rc=0
  wait "$(cat "$work/$version/pid")" || rc=$?
  echo "[tiers] torch $version (${pys[$version]}): fast tier, rc $rc"
  tail -n 3 "$work/$version/log"
  if [ $rc -ne 0 ]; then cat "$work/$version/log"; failed=1; fi
done
echo "[tiers] fast tiers: $((SECONDS - start)) s"
for version in $TIERS; do
  [ -n "${pys[$version]:-}" ] || continue
  start=$SECONDS
  if [ "$version" = "$NEWEST" ]; then jobs=("${NEWER[@]}"); else jobs=("${OLDER[@]}"); fi
  # on 2 xdist workers, a module at a time each (as tests/run.sh): the jobs' waits overlap
  "${pys[$version]}" -m pytest -q -p no:cacheprovider -n "${WORKERS:-2}" --dist loadscope \
    ${DURATIONS:+--durations=$DURATIONS} "${jobs[@]}" || failed=1
  echo "[tiers] torch $version: parity jobs $((SECONDS - start)) s"
done
exit $failed

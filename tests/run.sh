#!/usr/bin/env bash
# Install everything the tests need (pinned torch, test extras, Prometheus + Alertmanager from
# Debian), then run the whole suite. Extra arguments go to pytest (to both of its runs).
#   bash tests/run.sh            bash tests/run.sh -k alert -x
# First every test but those marked serial, on WORKERS (2) xdist workers, a module at a time per
# worker (--dist loadscope: a module's fixtures, and the jobs they spawn, run once), the longest
# modules first (conftest.py); much of the suite waits (Prometheus' alert windows, throttled
# jobs, spawned ranks starting), so two workers overlap those waits with work. Then, alone, the
# tests marked serial: they bound elapsed seconds. WORKERS=0: one process, as before.
set -uo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh --test || exit $?
workers=${WORKERS:-2}
parallel=(-n "$workers" --dist loadscope)
[ "$workers" = 0 ] && parallel=(-p no:xdist)
rc=0
python3 -m pytest -q --durations=20 "${parallel[@]}" --serial=skip "$@" || rc=$?
serial_rc=0
python3 -m pytest -q --durations=5 --serial=only "$@" || serial_rc=$?
# pytest's 5 is "no test selected": fine for one of the two runs (say, -k alert selects no serial test)
if [ $rc -eq 5 ] && [ $serial_rc -eq 5 ]; then exit 5; fi
[ $rc -eq 5 ] && rc=0
[ $serial_rc -eq 5 ] && serial_rc=0
[ $rc -ne 0 ] && exit $rc
exit $serial_rc

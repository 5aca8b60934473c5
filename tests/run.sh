#!/usr/bin/env bash
# Install everything the tests need (pinned torch, test extras, Prometheus + Alertmanager from
# Debian), then run the whole suite. Extra arguments go to pytest.
#   bash tests/run.sh            bash tests/run.sh -k alert -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh --test
exec python3 -m pytest -q --durations=20 "$@"

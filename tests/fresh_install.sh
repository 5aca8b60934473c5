#!/usr/bin/env bash
# A new user's first hour, step one: the README's main command, exactly as written, in a bare
# virtual environment (no numpy, no test extras, nothing this machine's Python has preinstalled),
# and a real scrape of the /metrics it serves. CI runs it before the suite (.ci/run); it catches
# a dependency distmon needs at run time but does not declare.
#   bash tests/fresh_install.sh [train.py flags...]     (default: --steps 60)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(mktemp -d)"
demo_pid=""
cleanup() {
    [ -n "$demo_pid" ] && kill -- -"$demo_pid" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

python3 -m venv "$work/venv"
# shellcheck disable=SC1091
. "$work/venv/bin/activate"
if python -c 'import numpy' 2>/dev/null; then
    echo "[fresh-install] FAIL: the new venv already has numpy; it would hide a missing dependency" >&2
    exit 1
fi

cd "$repo"
log="$work/demo.log"
flags=("$@")
[ ${#flags[@]} -gt 0 ] || flags=(--steps 60)
echo "[fresh-install] bash launch/demo.sh ${flags[*]}   (bare venv: $work/venv)"
set -m  # the demo in a process group of its own, so cleanup stops torchrun and its workers
bash launch/demo.sh "${flags[@]}" >"$log" 2>&1 &
demo_pid=$!
set +m

url="" scraped="" deadline=$((SECONDS + 900))
while kill -0 "$demo_pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do
    [ -n "$url" ] || url="$(grep -o 'serving metrics at http[^ ]*/metrics' "$log" | head -n1 | awk '{print $4}' || true)"
    if [ -n "$url" ] && body="$(curl -fsS --max-time 5 "$url" 2>/dev/null)"; then
        grep -q '^distmon_grad_norm{' <<<"$body" && scraped="$body"
    fi
    sleep 1
done
rc=0
wait "$demo_pid" || rc=$?
demo_pid=""
if [ $rc -ne 0 ] || [ -z "$scraped" ]; then
    echo "[fresh-install] FAIL: demo exit code $rc; metrics url '${url:-never announced}'; distmon_grad_norm scraped: $([ -n "$scraped" ] && echo yes || echo no)" >&2
    tail -n 40 "$log" >&2
    exit 1
fi
echo "[fresh-install] ok: the demo ran in a bare venv (exit 0) and served $url:"
grep -E '^distmon_(grad_norm|optimizer_steps_total)\{' <<<"$scraped" | head -n 3

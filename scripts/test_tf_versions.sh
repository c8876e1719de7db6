#!/usr/bin/env bash
# Run the fast core and parity tests against each given TensorFlow version, each in its own
# throwaway virtual environment, and print one PASS/FAIL line per version.
#
#   scripts/test_tf_versions.sh 2.16 2.21          # minor versions: the newest patch of each
#   scripts/test_tf_versions.sh oldest             # the oldest declared (compat.MIN_TF_VERSION)
#   TESTS="tests/test_parity.py" scripts/test_tf_versions.sh 2.17.1
#
# Environment: VENV_ROOT (default /tmp/memsave-tf-venvs; a venv is reused if present),
# TESTS (pytest arguments), TEST_TIMEOUT_S (per version, default 900), PYTHON (default python3).
# tensorflow-cpu is installed, and tf-keras with --no-deps: tf-keras requires the `tensorflow`
# wheel itself, which would install a second TensorFlow over tensorflow-cpu.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV_ROOT=${VENV_ROOT:-/tmp/memsave-tf-venvs}
PYTHON=${PYTHON:-python3}
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-900}
TESTS=${TESTS:-tests/test_parity.py tests/test_rewrite.py tests/test_second_order.py tests/test_packaging.py}
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Versions older than the declared range are refused at first use; this script probes them.
# tests/test_packaging.py (last) still fails on a version outside the declared range.
export MEMSAVE_GRADS_ALLOW_OLD_TENSORFLOW=1

if [ $# -eq 0 ]; then
    echo "usage: $0 TF_VERSION... (e.g. 2.16 2.21, or oldest)" >&2
    exit 2
fi

oldest_declared() {  # read from compat.py itself, so the range is stated in one place
    "$PYTHON" - "$ROOT/memsave_grads/_tf/compat.py" <<'PY'
import ast, sys
tree = ast.parse(open(sys.argv[1], encoding="utf-8").read())
for node in tree.body:
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "MIN_TF_VERSION":
        print("%d.%d" % ast.literal_eval(node.value))
PY
}

make_venv() {  # python -m venv, or virtualenv where the interpreter ships without ensurepip
    "$PYTHON" -m venv "$1" 2>/dev/null ||
        { "$PYTHON" -m pip install -q virtualenv && "$PYTHON" -m virtualenv -q "$1"; }
}

spec() {  # 2.16 -> ==2.16.* ; 2.16.1 -> ==2.16.1
    case "$1" in *.*.*) echo "==$1" ;; *) echo "==$1.*" ;; esac
}

failed=0
summary=()
for version in "$@"; do
    [ "$version" = oldest ] && version=$(oldest_declared)
    venv="$VENV_ROOT/tf-$version"
    log="$VENV_ROOT/tf-$version.log"
    mkdir -p "$VENV_ROOT"
    echo "=== TensorFlow $version: $venv (log: $log)"
    {
        [ -x "$venv/bin/python" ] || make_venv "$venv"
        # numpy<2 only where TF predates NumPy 2 support (TF < 2.18).
        numpy_spec="numpy"
        case "$version" in 2.1[0-7]|2.1[0-7].*) numpy_spec="numpy<2" ;; esac
        "$venv/bin/pip" install -q "tensorflow-cpu$(spec "$version")" "$numpy_spec" \
            "pytest>=7" "hypothesis>=6" "scipy>=1.9" "absl-py" &&
        "$venv/bin/pip" install -q --no-deps "tf-keras$(spec "$version")" &&
        "$venv/bin/pip" install -q --no-deps -e "$ROOT"
    } >"$log" 2>&1
    if [ $? -ne 0 ]; then
        tail -n 40 "$log"
        summary+=("FAIL $version (install; see $log)")
        failed=1
        continue
    fi
    installed=$("$venv/bin/python" -c \
        "import importlib.metadata as m; print(m.version('tensorflow-cpu'))" 2>/dev/null)
    # timeout kills a hung run; -k kills it for good if it ignores SIGTERM.
    timeout -k 30 "$TEST_TIMEOUT_S" "$venv/bin/python" -m pytest -q -x -p no:cacheprovider \
        $TESTS >>"$log" 2>&1
    rc=$?
    result=$(tail -n 1 "$log")
    if [ $rc -eq 0 ]; then
        summary+=("PASS $version (tensorflow-cpu $installed): $result")
    else
        tail -n 60 "$log"   # CI keeps only what is printed
        summary+=("FAIL $version (tensorflow-cpu $installed, rc $rc): $result; see $log")
        failed=1
    fi
done
printf '%s\n' "${summary[@]}"
exit $failed

#!/usr/bin/env bash
# Set up sparktrain's development environment: one of the two tested stacks, with TensorFlow,
# TensorFlowOnSpark, Horovod 0.28.1 (compiled for PyTorch with Gloo) and sparktrain itself.
#
#   ./scripts/setup.sh                            # primary stack (pyspark 4.3, NumPy 2) in .venv
#   SPARKTRAIN_STACK=spark35 ./scripts/setup.sh   # classic stack (pyspark 3.5, pyarrow 14,
#                                                 # NumPy 1.26, Petastorm) in .venv-spark35
#   SPARKTRAIN_SKIP_HOROVOD=1 ./scripts/setup.sh  # skip the Horovod compile (about 3 min)
#
# The primary stack also gets .venv-mlflow: a full `mlflow` (its tracking server, for
# tests/test_mlflow.py) in its own venv, because mlflow pins pyarrow < 26 (3.17.2); .venv has
# only the client (mlflow-skinny, the `mlflow` extra).
#
# Idempotent: a re-run with nothing changed takes about a second. The exact versions come from
# constraints/<stack>.txt; sparktrain's own requirements (setup.py) are ranges.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
stack="${SPARKTRAIN_STACK:-spark4}"
case "$stack" in
  spark4) default_venv="$root/.venv"; extras="torch,tf-cpu,tfos,connect,mlflow,test" ;;
  spark35) default_venv="$root/.venv-spark35"; extras="torch,tf-cpu,tfos,petastorm,test" ;;
  *) printf '[setup] error: SPARKTRAIN_STACK=%s is not a stack; use spark4 (default) or spark35\n' "$stack" >&2
     exit 1 ;;
esac
constraints="constraints/$stack.txt"
venv="${SPARKTRAIN_VENV:-$default_venv}"
python_bin="${PYTHON:-python3.11}"
wheel_cache="${SPARKTRAIN_WHEEL_CACHE:-$HOME/.cache/sparktrain/wheels}"
say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# --- prerequisites: Java 17 for Spark, Python 3.11 --------------------------------------------
if ! command -v java >/dev/null 2>&1 && [ -z "${JAVA_HOME:-}" ]; then
  die "Java was not found. Spark needs a JDK 17: on Debian/Ubuntu run
  'sudo apt-get update && sudo apt-get install -y openjdk-17-jdk-headless', or set JAVA_HOME."
fi
java_cmd="${JAVA_HOME:+$JAVA_HOME/bin/}java"
java_version="$("$java_cmd" -version 2>&1 | head -n1)"
case "$java_version" in
  *\"17.*|*\"21.*) ;;  # Spark 4 runs on Java 17 and 21 only; Spark 3.5 also on 8 and 11
  *) say "warning: found $java_version; Spark 4 needs Java 17 or 21 (apt-get install openjdk-17-jdk-headless)";;
esac
command -v "$python_bin" >/dev/null 2>&1 || die "$python_bin not found; install Python 3.11 or set PYTHON=/path/to/python3.11"

# --- fast path: nothing changed since the last successful run ---------------------------------
mlflow_server_version="3.17.2"  # the tests' tracking server (.venv-mlflow), primary stack only
mlflow_venv="$root/.venv-mlflow"
stamp_file="$venv/.sparktrain-setup-stamp"
stamp="$(cat setup.py "$constraints" scripts/setup.sh | sha256sum | cut -d' ' -f1)${SPARKTRAIN_SKIP_HOROVOD:+-nohvd}"
mlflow_ready() { [ "$stack" != spark4 ] || [ -x "$mlflow_venv/bin/mlflow" ]; }
if [ -x "$venv/bin/python" ] && [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] \
    && mlflow_ready; then
  say "environment up to date ($venv)"
  exit 0
fi

# --- the virtual environment and the Python stack ---------------------------------------------
[ -x "$venv/bin/python" ] || { say "creating $venv"; "$python_bin" -m venv "$venv"; }
pip=(pip_install)
# This machine's pip config may name index folders that do not exist; pip warns once per
# package about them. Keep real errors, drop that noise.
pip_install() {
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$constraints" "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
say "installing build tools"
"${pip[@]}" --upgrade pip "setuptools>=77.0.3,<81" wheel
say "installing torch 2.13.0"
"${pip[@]}" "torch==2.13.0"
say "installing sparktrain[$extras] on the $stack stack ($constraints)"
"${pip[@]}" -e ".[$extras]"

# --- Horovod, compiled against this torch ------------------------------------------------------
if [ -z "${SPARKTRAIN_SKIP_HOROVOD:-}" ] && ! "$venv/bin/python" -c "import horovod.torch" 2>/dev/null; then
  mkdir -p "$wheel_cache"
  torch_version="$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
  wheel_dir="$wheel_cache/horovod-0.28.1-torch$torch_version"
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    say "compiling Horovod 0.28.1 for torch $torch_version with Gloo (about 3 minutes on 2 cores)"
    command -v cmake >/dev/null 2>&1 || "${pip[@]}" "cmake>=3.13,<4"
    # Horovod's CMakeLists pins C++14, but torch >= 2.1 headers need C++17: a compiler wrapper
    # rewrites the standard flag (see DESIGN.md, "Verified dependency stack").
    wrap="$(mktemp -d)"
    trap 'rm -rf "$wrap"' EXIT
    cat > "$wrap/cxx" <<'WRAP'
#!/usr/bin/env bash
args=()
for a in "$@"; do
  case "$a" in
    -std=c++14) args+=(-std=c++17) ;;
    -std=gnu++14) args+=(-std=gnu++17) ;;
    *) args+=("$a") ;;
  esac
done
exec "${SPARKTRAIN_REAL_CXX:-g++}" "${args[@]}"
WRAP
    chmod +x "$wrap/cxx"
    CXX="$wrap/cxx" CC="${CC:-gcc}" PATH="$venv/bin:$PATH" \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
      "$venv/bin/python" -m pip wheel --quiet --no-deps --no-build-isolation --no-binary horovod \
        -c "$constraints" -w "$wheel_dir.tmp" "horovod==0.28.1" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    mv "$wheel_dir.tmp" "$wheel_dir"
  fi
  say "installing Horovod from $wheel_dir"
  "${pip[@]}" "$wheel_dir"/horovod-*.whl
  "$venv/bin/python" -c "import horovod.torch" || die "Horovod was installed but 'import horovod.torch' fails"
fi

# --- the tests' MLflow tracking server, in its own venv (primary stack) ------------------------
if [ "$stack" = spark4 ] && ! "$mlflow_venv/bin/python" -c "import mlflow, sys; \
    sys.exit(mlflow.__version__ != '$mlflow_server_version')" 2>/dev/null; then
  say "installing the MLflow tracking server $mlflow_server_version in $mlflow_venv"
  [ -x "$mlflow_venv/bin/python" ] || "$python_bin" -m venv "$mlflow_venv"
  "$mlflow_venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "mlflow==$mlflow_server_version" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
fi

imports="import sparktrain, pyspark, torch, tensorflow, keras, tensorflowonspark"
[ "$stack" = spark4 ] && imports="$imports, mlflow.pytorch, mlflow.keras, mlflow.spark"
[ "$stack" = spark35 ] && imports="$imports, petastorm"
TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/python" -c "$imports" \
  || die "the installed stack does not import"
echo "$stamp" > "$stamp_file"
say "done ($stack stack in $venv): $("$venv/bin/python" -c 'import pyspark, torch, pyarrow, numpy; print("pyspark", pyspark.__version__, "| numpy", numpy.__version__, "| pyarrow", pyarrow.__version__, "| torch", torch.__version__)')"

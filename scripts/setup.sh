#!/usr/bin/env bash
# Set up sparktrain in a virtual environment on one of the two tested stacks.
#
#   ./scripts/setup.sh            # .venv: sparktrain with PyTorch and scikit-learn: what
#                                 # jobs/train_torch.py --demo needs, and no more
#   ./scripts/setup.sh --keras    # ... and TensorFlow, Keras 3 and TensorFlowOnSpark
#                                 # (jobs/train_keras.py --demo)
#   ./scripts/setup.sh --connect  # ... and the Spark Connect client (--remote sc://...)
#   ./scripts/setup.sh --mlflow   # ... and the MLflow client (sparktrain.mlflow)
#   ./scripts/setup.sh --hf       # ... and transformers, tokenizers, peft (jobs/finetune_text.py)
#   ./scripts/setup.sh --all      # all four above: everything the demos and everyday use need
#   ./scripts/setup.sh --horovod  # ... and Horovod 0.28.1, compiled for this torch with Gloo
#                                 # (about 3 min on 2 cores the first time; the wheel is cached
#                                 # in ~/.cache/sparktrain/wheels and reused by every clone)
#   ./scripts/setup.sh --jvm-archive  # ... and the class archive local Spark JVMs start from
#                                 # (~40 s and 180 MiB once per Java and Spark; each JVM start
#                                 # then takes about half the CPU: worth it for many starts)
#   ./scripts/setup.sh --hadoop   # ... and hdfs-native (stores on hdfs://) and Hadoop's mini
#                                 # clusters for the tests (MiniDFSCluster, MiniYARNCluster: jars
#                                 # fetched once by Maven into ~/.cache/sparktrain/hadoop)
#   ./scripts/setup.sh --tests    # everything the quick tier of the tests needs (`pytest tests`):
#                                 # --all, --horovod, --jvm-archive and the test tools (pytest,
#                                 # coverage, ruff, mypy)
#   ./scripts/setup.sh --full-tests  # ... and what the full suite adds (`pytest tests --full`):
#                                 # --hadoop and .venv-mlflow (the tests' MLflow tracking server)
#   SPARKTRAIN_STACK=spark35 ./scripts/setup.sh ...   # the classic stack (pyspark 3.5,
#                                 # pyarrow 14, NumPy 1.26; --all adds Petastorm) in .venv-spark35
#
# Flags add up, and so do runs: what an earlier run installed stays (recorded in the venv's
# .sparktrain-setup-stamp), and a later run with more flags adds only what is missing.
#
# Installs with uv (https://docs.astral.sh/uv/, from PyPI, bootstrapped once into
# ~/.cache/sparktrain/uv): it resolves and installs many times faster than pip and honours the
# same constraints files. SPARKTRAIN_INSTALLER=pip uses pip instead (also the fallback when uv
# cannot be installed). The exact versions come from constraints/<stack>.txt; sparktrain's own
# requirements (setup.py) are ranges.
#
# Idempotent: a re-run with nothing changed takes about a second. Other settings: PYTHON (the
# interpreter, default python3.11), SPARKTRAIN_VENV (the venv's path),
# SPARKTRAIN_WHEEL_CACHE (where the Horovod wheel is kept).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# The parts a run can install; `base` always. The venv's stamp lists the parts it has.
asked="base"
for arg in "$@"; do
  case "$arg" in
    --keras) asked="$asked keras" ;;
    --connect) asked="$asked connect" ;;
    --mlflow) asked="$asked mlflow" ;;
    --hf) asked="$asked hf" ;;
    --all) asked="$asked all" ;;
    --horovod) asked="$asked horovod" ;;
    --jvm-archive) asked="$asked jvm-archive" ;;
    --hadoop) asked="$asked hadoop" ;;
    --tests) asked="$asked all horovod jvm-archive tests" ;;
    --full-tests) asked="$asked all horovod jvm-archive hadoop tests full-tests" ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option '$arg' (use --keras, --connect, --mlflow, --hf, --all, --horovod, --jvm-archive, --hadoop, --tests, --full-tests or --help)" ;;
  esac
done

stack="${SPARKTRAIN_STACK:-spark4}"
case "$stack" in
  spark4) default_venv="$root/.venv"; all_parts="keras connect mlflow hf" ;;
  # the Connect client needs pyspark 4; MLflow and Hugging Face are tested on spark4 only
  spark35) default_venv="$root/.venv-spark35"; all_parts="keras petastorm" ;;
  *) die "SPARKTRAIN_STACK=$stack is not a stack; use spark4 (default) or spark35" ;;
esac
asked="${asked//all/$all_parts}"
for part in $asked; do
  case "$part:$stack" in
    connect:spark35|mlflow:spark35|hf:spark35)
      die "--$part is not part of the spark35 stack (pyspark 3.5); use the default stack" ;;
  esac
done
extras_of() {  # extras_of PART: the setup.py extras a part installs
  case "$1" in
    base) echo "torch,examples" ;;
    keras) echo "tf-cpu,tfos" ;;
    tests) echo "test" ;;
    hadoop) echo "hdfs" ;;  # hdfs-native, the ranks' HDFS client; the mini clusters below
    horovod|jvm-archive|full-tests) ;;  # compiled / built below, not an extra
    *) echo "$1" ;;
  esac
}
constraints="constraints/$stack.txt"
venv="${SPARKTRAIN_VENV:-$default_venv}"
python_bin="${PYTHON:-python3.11}"
tool_cache="$HOME/.cache/sparktrain"
wheel_cache="${SPARKTRAIN_WHEEL_CACHE:-$tool_cache/wheels}"
mlflow_server_version="3.17.2"  # the tests' tracking server (.venv-mlflow), primary stack only
mlflow_venv="$root/.venv-mlflow"

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

# --- fast path: what is asked for is already there and nothing changed ------------------------
# The stamp's first line is the inputs' hash, its second the parts installed. The parts an
# earlier run installed stay wanted: a plain re-run after a pull brings them all up to date.
stamp_file="$venv/.sparktrain-setup-stamp"
inputs="$(cat setup.py "$constraints" scripts/setup.sh | sha256sum | cut -d' ' -f1)"
had_parts="" installed_parts=""
if [ -x "$venv/bin/python" ] && [ -f "$stamp_file" ]; then
  had_parts="$(sed -n 2p "$stamp_file")"
  [ "$(head -n1 "$stamp_file")" = "$inputs" ] && installed_parts="$had_parts"
fi
# A stamp from before the flags listed only `tests`, which then meant everything the tests need
case " $had_parts " in
  *" horovod "*) ;;
  *" tests "*) had_parts="$had_parts $all_parts horovod jvm-archive hadoop full-tests" ;;
esac
parts=""  # asked and had, in a fixed order, each once
for part in base keras connect mlflow hf petastorm horovod jvm-archive hadoop tests full-tests; do
  case " $asked $had_parts " in *" $part "*) parts="${parts:+$parts }$part" ;; esac
done
if [ -n "${SPARKTRAIN_SKIP_HOROVOD:-}" ]; then parts="${parts/ horovod/}"; fi  # kept from earlier versions
has() { case " $parts " in *" $1 "*) return 0 ;; esac; return 1; }
missing=""
for part in $parts; do
  case " $installed_parts " in *" $part "*) ;; *) missing="$missing $part" ;; esac
done
mlflow_ready() { ! has full-tests || [ "$stack" != spark4 ] || [ -x "$mlflow_venv/bin/mlflow" ]; }
# The class-data sharing archive local Spark JVMs start from (sparktrain/session/jvm_archive.py):
# built once per Java and Spark install, a no-op after. A JVM start then takes about half the
# CPU: it pays off for the tests (hundreds of JVMs), not for one demo run (its build is ~40 s).
jvm_archive() {
  has jvm-archive || return 0
  "$venv/bin/python" -c "import sys; from sparktrain.session.jvm_archive import java_options; sys.exit(not java_options())" 2>/dev/null && return 0
  say "building the JVM class archive in ~/.cache/sparktrain/jvm (about 40 s and 180 MiB, once per Java and Spark)"
  "$venv/bin/python" -m sparktrain.session.jvm_archive | grep -v "^sparktrain: building" \
    || say "warning: no JVM class archive; Spark JVMs start without it (slower, nothing else)"
}
# Hadoop's mini clusters for the tests (tests/support/hadoop.py: a MiniDFSCluster and a
# MiniYARNCluster in one JVM): their jars fetched once by Maven into ~/.cache/sparktrain/hadoop
# and scripts/hadoop/MiniHadoop.java compiled against them; again only when those files change.
# Beside them, in .../hadoop/s3a, Spark's s3a:// filesystem (hadoop-aws and the AWS SDK modules
# it loads, ~12 MiB: scripts/hadoop/s3a/pom.xml) for the s3a tests and for users' spark.jars.
hadoop_home="$tool_cache/hadoop"
mini_hadoop() {
  has hadoop || return 0
  local wanted
  wanted="$(cat scripts/hadoop/pom.xml scripts/hadoop/MiniHadoop.java scripts/hadoop/s3a/pom.xml \
    | sha256sum | cut -d' ' -f1)"
  [ "$(cat "$hadoop_home/stamp" 2>/dev/null)" = "$wanted" ] && return 0
  command -v mvn >/dev/null 2>&1 \
    || die "--hadoop fetches Hadoop's jars with Maven, which was not found (apt-get install maven)"
  say "fetching Hadoop's mini clusters and s3a with Maven into $hadoop_home (about 125 MiB and 45 s, once)"
  rm -rf "$hadoop_home.tmp" && mkdir -p "$hadoop_home.tmp/classes"
  local pom
  for pom in jars:scripts/hadoop/pom.xml s3a:scripts/hadoop/s3a/pom.xml; do
    mvn -q -B -Dstyle.color=never -f "${pom#*:}" dependency:copy-dependencies \
        -DoutputDirectory="$hadoop_home.tmp/${pom%%:*}" >&2 \
      || die "Maven could not fetch Hadoop's jars (see above; Maven Central must be reachable)"
  done
  "${JAVA_HOME:+$JAVA_HOME/bin/}javac" -nowarn -cp "$hadoop_home.tmp/jars/*" \
      -d "$hadoop_home.tmp/classes" scripts/hadoop/MiniHadoop.java \
    || die "scripts/hadoop/MiniHadoop.java does not compile (a JDK 17 is needed, not a JRE)"
  echo "$wanted" > "$hadoop_home.tmp/stamp"
  rm -rf "$hadoop_home" && mv "$hadoop_home.tmp" "$hadoop_home"
}
if [ -z "$missing" ] && mlflow_ready; then
  say "environment up to date ($venv: $installed_parts)"
  jvm_archive
  mini_hadoop
  exit 0
fi

# --- the installer: uv, or pip -----------------------------------------------------------------
filter_pip_noise() {
  # This machine's pip config may name index folders that do not exist; pip warns once per
  # package about them. Keep real errors, drop that noise.
  grep -v "is ignored: it is neither a file nor a directory" >&2 || true
}
uv_bin=""
if [ "${SPARKTRAIN_INSTALLER:-uv}" = uv ]; then
  if command -v uv >/dev/null 2>&1; then
    uv_bin="$(command -v uv)"
  else
    uv_bin="$tool_cache/uv/bin/uv"
    if [ ! -x "$uv_bin" ]; then
      say "installing uv into $tool_cache/uv (once)"
      { "$python_bin" -m venv "$tool_cache/uv" \
        && "$tool_cache/uv/bin/python" -m pip install --quiet --disable-pip-version-check "uv>=0.5" \
             2> >(filter_pip_noise); } || { say "uv could not be installed: using pip"; uv_bin=""; }
    fi
  fi
fi
# uv does not read pip's configuration: carry over where pip is told to look for packages
# (a local wheel folder, a mirror), and pick like pip does, the best version over all indexes
# (uv's default would stop at the first index that has a package at all).
uv_sources=(--index-strategy unsafe-best-match)
if [ -n "$uv_bin" ]; then
  while IFS= read -r line; do
    key="${line%%=*}"; value="${line#*=}"; value="${value#\'}"; value="${value%\'}"
    for location in $value; do
      case "${key##*.}" in
        index-url) uv_sources+=(--default-index "$location") ;;
        extra-index-url) uv_sources+=(--index "$location") ;;
        find-links) uv_sources+=(--find-links "$location") ;;
      esac
    done
  done < <("$python_bin" -m pip config list 2>/dev/null || true)
fi
make_venv() {  # make_venv DIR
  if [ -n "$uv_bin" ]; then "$uv_bin" venv --quiet --seed --python "$python_bin" "$1"
  else "$python_bin" -m venv "$1"; fi
}
# Packages are installed with their bytecode (.pyc) compiled, as pip does by default and uv only
# when asked: where PYTHONDONTWRITEBYTECODE is set (many container images set it) Python never
# writes it, and every process (each Spark Python worker daemon, rank, job) compiled torch,
# pyspark and the rest from source again: ~5 CPU-s each, the demo's warm run 34 s -> 21 s.
install_into() {  # install_into VENV PIP-ARGS...
  local target="$1"; shift
  if [ -n "$uv_bin" ]; then
    "$uv_bin" pip install --quiet --compile-bytecode --python "$target/bin/python" \
      "${uv_sources[@]}" "$@"
  else
    "$target/bin/python" -m pip install --quiet --disable-pip-version-check "$@" \
      2> >(filter_pip_noise)
  fi
}

# --- the virtual environment and the Python stack ---------------------------------------------
if [ ! -x "$venv/bin/python" ]; then say "creating $venv"; make_venv "$venv"; fi
rm -f "$stamp_file"
extras=""
for part in $parts; do
  e="$(extras_of "$part")"; [ -n "$e" ] && extras="${extras:+$extras,}$e"
done
# Rough durations on 2 cores with uv and an empty cache (measured: base ~1 min under light load,
# 2 min at load 12; TensorFlow and the other parts download ~1 GB more); from uv's cache
# (another clone, a re-run) seconds each.
estimate="about 1 min"
{ has keras || has hf; } && estimate="about 2 min"
has tests && estimate="about 3 min"
estimate="$estimate the first time, seconds from the cache"
[ -n "$uv_bin" ] || estimate="several minutes the first time (uv: ${estimate%%,*})"
installer="pip"; [ -n "$uv_bin" ] && installer="uv"
say "installing sparktrain[$extras] on the $stack stack ($constraints) with $installer${had_parts:+ (the venv had: $had_parts)}: $estimate"
# setuptools (torch needs >= 77.0.3, tensorflowonspark and petastorm import pkg_resources: < 81)
# and wheel are also Horovod's build tools.
install_into "$venv" -c "$constraints" pip "setuptools>=77.0.3,<81" wheel -e ".[$extras]"
# PyPI's torch is the CUDA build, which brings Triton (torch.compile's GPU kernels). Triton's
# native module crashes (SIGSEGV) a process that imported TensorFlow before it (seen with torch
# 2.13 + triton + tensorflow-cpu 2.21: `import tensorflow, peft`), as a Python worker that ran a
# Keras fit and then a torch one would. Without an NVIDIA GPU Triton has nothing to run on and
# torch works without it (torch.utils._triton.has_triton_package): leave it out there.
if ! { command -v nvidia-smi >/dev/null 2>&1 || [ -e /dev/nvidia0 ]; } \
    && "$venv/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('triton') is None)" 2>/dev/null; then
  say "removing Triton (no NVIDIA GPU here; it crashes processes that also import TensorFlow)"
  if [ -n "$uv_bin" ]; then "$uv_bin" pip uninstall --quiet --python "$venv/bin/python" triton
  else "$venv/bin/python" -m pip uninstall --quiet --yes triton; fi
fi

# --- Horovod, compiled against this torch ------------------------------------------------------
if has horovod; then
  mkdir -p "$wheel_cache"
  torch_version="$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
  wheel_dir="$wheel_cache/horovod-0.28.1-torch$torch_version"
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1 \
      && ! "$venv/bin/python" -c "import horovod.torch" 2>/dev/null; then
    say "compiling Horovod 0.28.1 for torch $torch_version with Gloo (about 3 minutes on 2 cores, once)"
    command -v cmake >/dev/null 2>&1 || install_into "$venv" "cmake>=3.13,<4"
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
    rm -rf "$wheel_dir.tmp"
    CXX="$wrap/cxx" CC="${CC:-gcc}" PATH="$venv/bin:$PATH" \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
      "$venv/bin/python" -m pip wheel --quiet --disable-pip-version-check --no-deps \
        --no-build-isolation --no-binary horovod -c "$constraints" -w "$wheel_dir.tmp" \
        "horovod==0.28.1" 2> >(filter_pip_noise)
    mv "$wheel_dir.tmp" "$wheel_dir"
  fi
  if ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    # with its dependencies (pyyaml, cloudpickle, psutil): Horovod imports them at run time
    say "installing Horovod from $wheel_dir (seconds)"
    install_into "$venv" -c "$constraints" "$wheel_dir"/horovod-*.whl
  fi
  "$venv/bin/python" -c "import horovod.torch" || die "Horovod was installed but 'import horovod.torch' fails"
fi

# --- the tests' MLflow tracking server, in its own venv (primary stack) ------------------------
# mlflow pins pyarrow < 26 (3.17.2), so the server cannot live in .venv, which has only the
# client (mlflow-skinny, the `mlflow` extra).
if has full-tests && [ "$stack" = spark4 ] && ! "$mlflow_venv/bin/python" -c "import mlflow, sys; \
    sys.exit(mlflow.__version__ != '$mlflow_server_version')" 2>/dev/null; then
  say "installing the MLflow tracking server $mlflow_server_version in $mlflow_venv (about 30 s the first time)"
  [ -x "$mlflow_venv/bin/python" ] || make_venv "$mlflow_venv"
  install_into "$mlflow_venv" "mlflow==$mlflow_server_version"
fi

# Each part imports: a broken install fails here, not in the first job.
imports="import sparktrain, pyspark, torch, sklearn, pyarrow, numpy"
has keras && imports="$imports, tensorflow, keras, tensorflowonspark"
has connect && imports="$imports, pyspark.sql.connect.session"
has mlflow && imports="$imports, mlflow.pytorch, mlflow.spark"
has mlflow && has keras && imports="$imports, mlflow.keras"
has hf && imports="$imports, transformers, peft, llguidance"
has petastorm && imports="$imports, petastorm"
has hadoop && imports="$imports, hdfs_native.fsspec"
has tests && imports="$imports, pytest, xdist"
say "checking that the installed parts import ($parts; seconds)"
versions="$(TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/python" -c "$imports; print('pyspark', pyspark.__version__, '| numpy', numpy.__version__, '| pyarrow', pyarrow.__version__, '| torch', torch.__version__)" \
  2> >(grep -v "^WARNING: All log messages\|oneDNN\|cpu_feature_guard\|rebuild TensorFlow" >&2 || true))" \
  || die "the installed stack does not import"
# sparktrain's own modules (an editable install: no installer compiles them), the jobs' and,
# for --tests, the tests'
compile_dirs="sparktrain jobs"
has tests && compile_dirs="$compile_dirs tests"
"$venv/bin/python" -m compileall -q -j 0 $compile_dirs >/dev/null \
  || say "warning: could not compile sparktrain's bytecode (it is compiled at each import then)"
printf '%s\n%s\n' "$inputs" "$parts" > "$stamp_file"
jvm_archive
mini_hadoop
say "done ($stack stack in $venv: $parts): $versions"

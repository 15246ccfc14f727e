#!/usr/bin/env bash
# Build Horovod from its PyPI source release against the torch installed in a
# virtual environment, cache the wheel, and install it into that environment.
#
# Usage: scripts/build_horovod.sh [VENV] [options]
#   VENV, --venv DIR  the virtual environment to build against and install into
#                     (default: $VIRTUAL_ENV if set, else <repo>/.venv)
#   --cache DIR       cache root (default: ${RINGWRIGHT_CACHE:-$HOME/.cache/ringwright})
#   --jobs N          parallel compile jobs (default: number of CPUs, at most 4:
#                     each g++ on torch headers takes about 1 GiB)
#   --wheel-dir DIR   also copy the wheel there (e.g. a Docker build stage)
#   --rebuild         ignore a cached wheel and build again
#   --no-install      build (or find) the wheel, do not install it
#   --smoke           run the check (import, hvd.init(), gloo allreduce) even
#                     when the venv already had this wheel (default: only after
#                     an install)
#   --no-smoke        never run that check
#   --print-key       print the cache key for this venv and exit
#   -h, --help        this text
#
# The wheel lands in <cache>/wheels/<key>/ where the key is made of the Horovod
# version, the torch version and source commit, the Python tag, the machine and
# a hash of this script, so any change to the recipe or to torch builds a new
# wheel, and a warm run only installs the cached one (or, when the venv already
# has it, does nothing: about a second). Nothing is read from stdin; safe with
# CI=true. Exit status 0 only when the venv ends up with a working Horovod.
#
# Build recipe (why each piece is there):
#   * HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 and WITHOUT MPI/TensorFlow/MXNet:
#     a CPU-controller (gloo) build; GPU collectives are not built
#     (HOROVOD_GPU_* are cleared), GPU tensors are not the target of this image.
#   * HOROVOD_CPU_OPERATIONS=GLOO at build time makes gloo the compiled-in default
#     for CPU collectives (without MPI the default would otherwise name MPI).
#   * The C++ standard torch needs: Horovod's CMake pins CMAKE_CXX_STANDARD 14
#     (g++ gets -std=gnu++14; bundled gloo also passes -std=c++11), but torch
#     headers need newer: C++17 for torch 2.x, C++20 for recent torch (they
#     `#error` on `__cplusplus < 202002L`). The script reads that threshold from
#     torch's ATen/ATen.h (never lower than C++17) and a tiny CXX wrapper rewrites
#     every -std=(c|gnu)++11/14/17 into the same flavour of that standard, then
#     execs g++: one standard for every object in the library.
#   * -g0: setup.py always configures RelWithDebInfo; the wrapper appends -g0
#     so the wheel carries no DWARF (much smaller, faster to compile).
#   * cmake 3.x from the system (HOROVOD_CMAKE): cmake 4 refuses the old
#     cmake_minimum_required of Horovod's bundled third-party projects. The wheel
#     is built with --no-build-isolation so pip never fetches cmake (or anything
#     else) into an isolated build environment; the build dependencies are
#     installed into the target venv first (they are Horovod's runtime deps too).
#   * MAKEFLAGS=-jN: Horovod's setup.py passes -j8 to make unless MAKEFLAGS is set.
#   * The patches in scripts/horovod-patches/ are applied to the source release
#     (patch -p1, in name order) and are part of the cache key. Each says at its top
#     what it changes and why.
set -Eeuo pipefail

HOROVOD_VERSION=0.28.1
# sha256 of horovod-0.28.1.tar.gz on PyPI; pip refuses any other file.
HOROVOD_SDIST_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
# Horovod's own runtime deps (setup.py install_requires), needed to build too
# (setup.py lists them as setup_requires for build actions).
BUILD_DEPS=(setuptools wheel packaging cloudpickle psutil pyyaml "cffi>=1.4.0")

SCRIPT_PATH="$(readlink -f "${BASH_SOURCE[0]}")"
REPO_ROOT="$(cd "$(dirname "$SCRIPT_PATH")/.." && pwd)"
START_TS=$(date +%s)

log()  { printf '[build_horovod %4ss] %s\n' "$(( $(date +%s) - START_TS ))" "$*"; }
die()  { printf '[build_horovod] ERROR: %s\n' "$1" >&2; shift; for l in "$@"; do printf '[build_horovod]   %s\n' "$l" >&2; done; exit 1; }
usage() { sed -n '2,/^set -Eeuo/p' "$SCRIPT_PATH" | sed '$d' | sed 's/^# \{0,1\}//'; }

VENV="${VIRTUAL_ENV:-$REPO_ROOT/.venv}"
CACHE_ROOT="${RINGWRIGHT_CACHE:-${HOME:-/root}/.cache/ringwright}"
NCPU=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)
JOBS=$(( NCPU > 4 ? 4 : NCPU ))
WHEEL_DIR=""
REBUILD=0
INSTALL=1
SMOKE=auto
PRINT_KEY=0

while [ $# -gt 0 ]; do
  case "$1" in
    -*) ;;
    *) VENV="$1"; shift; continue ;;
  esac
  case "$1" in
    --venv) VENV="${2:?--venv needs a directory}"; shift 2 ;;
    --venv=*) VENV="${1#*=}"; shift ;;
    --cache) CACHE_ROOT="${2:?--cache needs a directory}"; shift 2 ;;
    --cache=*) CACHE_ROOT="${1#*=}"; shift ;;
    --jobs) JOBS="${2:?--jobs needs a number}"; shift 2 ;;
    --jobs=*) JOBS="${1#*=}"; shift ;;
    --wheel-dir) WHEEL_DIR="${2:?--wheel-dir needs a directory}"; shift 2 ;;
    --wheel-dir=*) WHEEL_DIR="${1#*=}"; shift ;;
    --rebuild) REBUILD=1; shift ;;
    --no-install) INSTALL=0; shift ;;
    --smoke) SMOKE=1; shift ;;
    --no-smoke) SMOKE=0; shift ;;
    --print-key) PRINT_KEY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument: $1" "run '$0 --help' for the options" ;;
  esac
done
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || die "--jobs must be a positive integer, got '$JOBS'"

# ---------------------------------------------------------------- the venv
PY="$VENV/bin/python"
[ -x "$PY" ] || die "no Python at $PY" \
  "create the venv first (python3.11 -m venv .venv && .venv/bin/pip install torch)," \
  "or pass --venv DIR / set VIRTUAL_ENV"
VENV="$(cd "$VENV" && pwd)"
PY="$VENV/bin/python"

# Run Python outside the repo: <repo>/operator would shadow the stdlib `operator`
# when the current directory is on sys.path.
py() { (cd / && "$PY" "$@"); }

# Facts about torch, read from its files without importing it (a warm run then
# takes about a second): version and source commit (torch/version.py), and the
# C++ standard its headers demand (the `__cplusplus < NNNNNNL` guard in
# ATen/ATen.h; never below C++17).
TORCH_INFO="$(py -c 'import importlib.util, os, platform, re, sys
spec = importlib.util.find_spec("torch")
if spec is None or not spec.origin:
    sys.exit("torch is not installed")
root = os.path.dirname(spec.origin)
ver = open(os.path.join(root, "version.py")).read()
get = lambda k: (re.search(k + r"\s*(?::[^=]*)?=\s*[\x27\x22]([^\x27\x22]*)", ver) or [None, ""])[1]
print(get("__version__") or sys.exit("no __version__ in torch/version.py"))
print((get("git_version") or "nogit")[:10])
print("cp%d%d" % sys.version_info[:2])
print(platform.machine())
aten = open(os.path.join(root, "include", "ATen", "ATen.h")).read()
m = re.search(r"__cplusplus\s*<\s*(\d{4})(\d\d)L", aten)
print(max(17, int(m.group(1)) % 100 if m else 17))' 2>&1)" \
  || die "cannot read torch in $VENV:" "$TORCH_INFO" \
       "install it first: $PY -m pip install torch"
{ read -r TORCH_VERSION; read -r TORCH_GIT; read -r PY_TAG; read -r MACHINE; read -r CXX_STD; } <<<"$TORCH_INFO"
[[ "$CXX_STD" =~ ^[0-9]+$ ]] || die "could not read torch's build facts from $VENV:" "$TORCH_INFO"

PATCH_DIR="$(dirname "$SCRIPT_PATH")/horovod-patches"
PATCHES=()
if [ -d "$PATCH_DIR" ]; then mapfile -t PATCHES < <(compgen -G "$PATCH_DIR/*.patch" | sort); fi
# The recipe is this script and its patches.
SCRIPT_HASH="$(cat "$SCRIPT_PATH" "${PATCHES[@]}" | sha256sum | cut -c1-12)"
KEY="horovod-${HOROVOD_VERSION}-torch-${TORCH_VERSION}-${TORCH_GIT}-${PY_TAG}-${MACHINE}-${SCRIPT_HASH}"
KEY="${KEY//[^A-Za-z0-9._+-]/_}"
if [ "$PRINT_KEY" = 1 ]; then echo "$KEY"; exit 0; fi

WHEELS_ROOT="$CACHE_ROOT/wheels"
ENTRY="$WHEELS_ROOT/$KEY"
mkdir -p "$WHEELS_ROOT" || die "cannot create the cache directory $WHEELS_ROOT" \
  "set RINGWRIGHT_CACHE or --cache to a writable directory"

log "venv:   $VENV (torch $TORCH_VERSION @${TORCH_GIT}, $PY_TAG, $MACHINE, headers need C++$CXX_STD)"
log "cache:  $ENTRY"

# Resident memory (KiB) of a process and all its descendants.
tree_rss_kb() {
  { ps -eo pid=,ppid=,rss= 2>/dev/null || true; } | awk -v root="$1" '
    { parent[$1] = $2; rss[$1] = $3 }
    END {
      total = 0
      for (p in parent) {
        q = p
        while (q != "" && q != root && q in parent && q != parent[q]) q = parent[q]
        if (q == root) total += rss[p]
      }
      print total
    }'
}

cached_wheel() { compgen -G "$ENTRY/horovod-${HOROVOD_VERSION}-*.whl" | head -n1; }

# ---------------------------------------------------------------- the build
build_wheel() {
  # cmake 3.x, never pip's cmake 4.
  local cmake_bin="${HOROVOD_CMAKE:-}"
  if [ -z "$cmake_bin" ]; then
    for c in /usr/bin/cmake /usr/local/bin/cmake; do [ -x "$c" ] && { cmake_bin=$c; break; }; done
  fi
  [ -n "$cmake_bin" ] && [ -x "$cmake_bin" ] || die "no cmake found" \
    "install cmake 3.13..3.x (Debian/Ubuntu: apt-get install -y cmake) or set HOROVOD_CMAKE=/path/to/cmake"
  local cmake_ver
  cmake_ver="$("$cmake_bin" --version | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')"
  case "$cmake_ver" in
    3.1[3-9]*|3.[2-9][0-9]*) ;;
    *) die "cmake $cmake_ver at $cmake_bin cannot build Horovod $HOROVOD_VERSION" \
         "it needs cmake 3.13..3.x (cmake 4 refuses Horovod's bundled third-party CMakeLists)" \
         "install the distribution's cmake (apt-get install -y cmake) or set HOROVOD_CMAKE" ;;
  esac
  local real_cxx="${RINGWRIGHT_REAL_CXX:-$(command -v g++ || true)}"
  [ -n "$real_cxx" ] || die "no g++ found" "install g++ with C++$CXX_STD support: apt-get install -y g++ (g++ >= 10)"
  command -v gcc >/dev/null || die "no gcc found" "apt-get install -y gcc"
  command -v make >/dev/null || die "no make found" "apt-get install -y make"

  local work
  work="$(mktemp -d "$WHEELS_ROOT/.build-XXXXXX")"
  # shellcheck disable=SC2064
  trap "rm -rf '$work'" EXIT
  mkdir -p "$work/bin" "$work/sdist" "$work/dist" "$work/tmp"

  log "build deps into the venv (no cmake from PyPI): ${BUILD_DEPS[*]}"
  py -m pip install --disable-pip-version-check --no-input -q "${BUILD_DEPS[@]}" \
    >"$work/pip-deps.log" 2>&1 \
    || { tail -n 30 "$work/pip-deps.log" >&2; die "could not install the build dependencies into $VENV" \
           "check network access to the package index, or pre-install: ${BUILD_DEPS[*]}"; }

  log "download horovod==$HOROVOD_VERSION source release (sha256 pinned)"
  printf 'horovod==%s --hash=sha256:%s\n' "$HOROVOD_VERSION" "$HOROVOD_SDIST_SHA256" >"$work/req.txt"
  py -m pip download --disable-pip-version-check --no-input --no-deps --no-binary :all: \
      --no-build-isolation --require-hashes -r "$work/req.txt" -d "$work/sdist" \
      >"$work/pip-download.log" 2>&1 \
    || { tail -n 30 "$work/pip-download.log" >&2; die "could not download horovod==$HOROVOD_VERSION" \
           "check network access to the package index (pip download --no-binary :all: horovod==$HOROVOD_VERSION)"; }
  local sdist
  sdist="$(compgen -G "$work/sdist/horovod-${HOROVOD_VERSION}.tar.gz" | head -n1)" \
    || die "the download left no horovod-${HOROVOD_VERSION}.tar.gz in $work/sdist"
  if [ "${#PATCHES[@]}" -gt 0 ]; then
    tar -xzf "$sdist" -C "$work/sdist" || die "cannot unpack $sdist"
    sdist="$work/sdist/horovod-${HOROVOD_VERSION}"
    local p
    for p in "${PATCHES[@]}"; do
      log "apply $(basename "$p")"
      patch -d "$sdist" -p1 --forward --batch <"$p" >"$work/patch.log" 2>&1 \
        || { cat "$work/patch.log" >&2; die "$(basename "$p") does not apply to horovod $HOROVOD_VERSION" \
               "it was written for that release's source; update the patch with the version"; }
    done
  fi

  # The compiler wrapper (see the header of this file).
  cat >"$work/bin/g++-std" <<EOF
#!/bin/sh
# Rewrites -std=c++11/14/17 and -std=gnu++11/14/17 into C++$CXX_STD; drops debug info.
for a do
  shift
  case "\$a" in
    -std=c++11|-std=c++14|-std=c++1y|-std=c++17|-std=c++1z) a=-std=c++$CXX_STD ;;
    -std=gnu++11|-std=gnu++14|-std=gnu++1y|-std=gnu++17|-std=gnu++1z) a=-std=gnu++$CXX_STD ;;
  esac
  set -- "\$@" "\$a"
done
exec "$real_cxx" "\$@" -g0
EOF
  chmod +x "$work/bin/g++-std"

  log "compile horovod $HOROVOD_VERSION (cmake $cmake_ver, $("$real_cxx" -dumpfullversion) as C++$CXX_STD, -j$JOBS); full log: $ENTRY/build.log once done"
  local timefile="$work/time.txt" rc=0
  local -a timer=()
  if [ -x /usr/bin/time ]; then timer=(/usr/bin/time -v -o "$timefile"); fi
  local build_start gcc_bin
  build_start=$(date +%s)
  gcc_bin="$(command -v gcc)"
  (
    cd "$work/tmp"
    # Only what this recipe sets reaches the build: no stray GPU/MPI knobs.
    for v in $(compgen -e | grep -E '^HOROVOD_' || true); do unset "$v"; done
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
           HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
           HOROVOD_CPU_OPERATIONS=GLOO HOROVOD_CMAKE="$cmake_bin" \
           CC="$gcc_bin" CXX="$work/bin/g++-std" \
           MAKEFLAGS="-j$JOBS" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
           TMPDIR="$work/tmp" PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
    unset CFLAGS CXXFLAGS CPPFLAGS LDFLAGS
    exec "${timer[@]}" "$PY" -m pip wheel -v --no-deps --no-build-isolation --no-cache-dir \
      -w "$work/dist" "$sdist"
  ) >"$work/build.log" 2>&1 &
  local pid=$!
  # Progress: CMake's "[ NN%]" lines, at most one line per 30 s; meanwhile
  # sample the resident memory of the whole build process tree every 2 s.
  local last=0 pct rss tree_peak_kb=0
  while kill -0 "$pid" 2>/dev/null; do
    sleep 2
    rss="$(tree_rss_kb "$pid")"
    if [ "${rss:-0}" -gt "$tree_peak_kb" ]; then tree_peak_kb=$rss; fi
    if [ $(( $(date +%s) - last )) -ge 30 ]; then
      pct="$(grep -oE '^ *\[ *[0-9]+%\] [A-Za-z]+.*' "$work/build.log" 2>/dev/null | tail -n1 | sed 's/^ *//' | cut -c1-100 || true)"
      log "  ... ${pct:-configuring} (build RSS now $(( ${rss:-0} / 1024 )) MiB)"
      last=$(date +%s)
    fi
  done
  wait "$pid" || rc=$?
  local build_secs=$(( $(date +%s) - build_start ))
  local whl
  whl="$(compgen -G "$work/dist/horovod-${HOROVOD_VERSION}-*.whl" | head -n1 || true)"
  if [ "$rc" != 0 ] || [ -z "$whl" ]; then
    local keep="$WHEELS_ROOT/failed-build.log"
    cp "$work/build.log" "$keep" 2>/dev/null || true
    echo "----- last 60 lines of the build log -----" >&2
    tail -n 60 "$work/build.log" >&2
    echo "----- first compiler errors -----" >&2
    grep -m 10 -E 'error:|Error [0-9]|CMake Error' "$work/build.log" >&2 || true
    die "building horovod $HOROVOD_VERSION failed after ${build_secs}s (exit $rc); full log: $keep" \
      "torch $TORCH_VERSION may need another compile fix in this script's recipe;" \
      "out of memory (g++ killed)? retry with --jobs 1"
  fi
  if [ -s "$timefile" ]; then
    local peak_kb
    peak_kb="$(sed -n 's/.*Maximum resident set size (kbytes): *//p' "$timefile")"
    log "compiled in ${build_secs}s; peak RSS: $(( tree_peak_kb / 1024 )) MiB for the whole build (sampled), $(( ${peak_kb:-0} / 1024 )) MiB for its largest process"
  else
    log "compiled in ${build_secs}s; peak RSS: $(( tree_peak_kb / 1024 )) MiB for the whole build (sampled)"
  fi

  # Publish atomically: a reader sees either no entry or a complete one.
  local stage="$work/entry"
  mkdir -p "$stage"
  cp "$whl" "$stage/"
  cp "$work/build.log" "$stage/build.log"
  if [ -s "$timefile" ]; then cp "$timefile" "$stage/time.txt"; fi
  {
    echo "horovod=$HOROVOD_VERSION"
    echo "torch=$TORCH_VERSION"
    echo "python=$PY_TAG"
    echo "machine=$MACHINE"
    echo "torch_git=$TORCH_GIT"
    echo "script_sha256=$(sha256sum "$SCRIPT_PATH" | cut -d' ' -f1)"
    echo "cmake=$cmake_ver"
    echo "cxx=$("$real_cxx" -dumpfullversion) with -std=(c|gnu)++$CXX_STD -g0"
    echo "jobs=$JOBS"
    echo "build_seconds=$build_secs"
    echo "build_peak_rss_mib=$(( tree_peak_kb / 1024 ))"
    echo "built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  } >"$stage/BUILD_INFO"
  rm -rf "$ENTRY"
  mv "$stage" "$ENTRY"
  rm -rf "$work"
  trap - EXIT
}

# One build per cache at a time (parallel CI jobs share the cache).
if command -v flock >/dev/null; then
  exec 9>"$WHEELS_ROOT/.lock"
  if ! flock -n 9; then
    log "another build holds $WHEELS_ROOT/.lock; waiting (up to 60 min)"
    flock -w 3600 9 || die "timed out waiting for $WHEELS_ROOT/.lock" "remove it if no build is running"
  fi
fi

WHEEL="$(cached_wheel || true)"
if [ -n "$WHEEL" ] && [ "$REBUILD" = 0 ]; then
  log "cached wheel found: $(basename "$WHEEL") (no build)"
else
  if [ "$REBUILD" = 1 ]; then log "--rebuild: ignoring any cached wheel"; fi
  build_wheel
  WHEEL="$(cached_wheel || true)"
  [ -n "$WHEEL" ] || die "the build finished but no wheel is in $ENTRY"
fi

if [ -n "$WHEEL_DIR" ]; then
  mkdir -p "$WHEEL_DIR" && cp -f "$WHEEL" "$WHEEL_DIR/"
  log "copied the wheel to $WHEEL_DIR/"
fi

# ---------------------------------------------------------------- install
if [ "$INSTALL" = 1 ]; then
  MARKER="$VENV/.ringwright-horovod"
  WHEEL_SHA="$(sha256sum "$WHEEL" | cut -d' ' -f1)"
  if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$WHEEL_SHA" ] \
     && compgen -G "$VENV/lib/python*/site-packages/horovod/torch/mpi_lib_v2*.so" >/dev/null; then
    log "the venv already has this wheel installed"
  else
    log "installing $(basename "$WHEEL") into $VENV"
    rm -f "$MARKER"
    out="$(py -m pip install --disable-pip-version-check --no-input --force-reinstall --no-deps "$WHEEL" 2>&1 \
           && py -m pip install --disable-pip-version-check --no-input "$WHEEL" 2>&1)" \
      || die "pip could not install $WHEEL into $VENV:" "$out"
    echo "$WHEEL_SHA" >"$MARKER"
    if [ "$SMOKE" = auto ]; then SMOKE=1; fi
  fi
  if [ "$SMOKE" = 1 ]; then
    # One process, no HOROVOD_* at all: Horovod uses its in-memory store.
    out="$(cd / && for v in $(compgen -e | grep -E '^HOROVOD_' || true); do unset "$v"; done
           timeout 120 "$PY" -c '
import torch, horovod.torch as hvd
hvd.init()
assert hvd.gloo_enabled() and hvd.size() == 1, (hvd.gloo_enabled(), hvd.size())
t = hvd.allreduce(torch.ones(3), op=hvd.Sum)
assert t.tolist() == [1.0, 1.0, 1.0], t
hvd.shutdown()
print("ok")' 2>&1)" \
      || { rm -f "$MARKER"; die "the installed horovod does not work in $VENV:" "$out" \
             "rebuild with: $0 --rebuild"; }
    log "smoke check passed (import horovod.torch, hvd.init(), gloo, allreduce)"
  fi
fi

log "done in $(( $(date +%s) - START_TS ))s: $WHEEL"

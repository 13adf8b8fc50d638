#!/usr/bin/env bash
# Builds Horovod 0.28.1 for this venv's TensorFlow and installs it; `make horovod` runs this.
#
# Horovod 0.28.1 does not build against TF 2.21 from PyPI: horovod/tensorflow/xla_mpi_ops.cc
# includes XLA headers the TF 2.21 wheel no longer ships (first error
# `highwayhash/arch_specific.h: No such file`). Everything in that file is GPU-only, so
# tools/horovod/horovod-0.28.1-tf2.21.patch compiles it only with HAVE_GPU. The rest builds as is. The
# patch also fixes one bug: the Gloo context of a process set (the global one included) ignored
# HOROVOD_GLOO_IFACE and took the hostname's address, a loopback one on Debian, so ranks on
# different hosts could not connect (found across tools/cluster/netcluster.py's hosts).
#
# The wheel is cached outside the repo, keyed by Horovod, TF and Python versions and the
# collectives built in, so only the first set-up on a machine pays the ~4-minute build.
# Gloo is always built; MPI too when Debian's Open MPI (`mpicc`) is present.
#
# Usage: tools/horovod/build.sh [path/to/venv/bin]        (default: .venv/bin)
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:-.venv/bin}
HVD=0.28.1
PATCH=tools/horovod/horovod-$HVD-tf2.21.patch
TF=$("$BIN/python" -c 'import importlib.metadata as m; print(m.version("tensorflow-cpu"))' 2>/dev/null ||
     "$BIN/python" -c 'import tensorflow as tf; print(tf.__version__)')
PY=$("$BIN/python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
OPS=gloo
if command -v mpicc >/dev/null; then OPS=gloo-mpi; fi
PATCH_SUM=$(sha256sum "$PATCH" | cut -c1-12)
CACHE=${TFDIST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tfdist}/wheels/horovod-$HVD-tf$TF-$PY-$OPS-$PATCH_SUM

if "$BIN/python" -c "import horovod.tensorflow as h; assert h.gloo_built()" 2>/dev/null &&
   [ "$("$BIN/python" -c 'import horovod; print(horovod.__version__)')" = "$HVD" ] &&
   [ -f "$BIN/../.horovod-$(basename "$CACHE")" ]; then
  exit 0  # already installed from this cache key
fi

if ! ls "$CACHE"/horovod-*.whl >/dev/null 2>&1; then
  for tool in cmake g++ make; do
    command -v $tool >/dev/null || { echo "build_horovod: $tool is needed to build Horovod (apt-get install cmake g++ make)" >&2; exit 2; }
  done
  echo "build_horovod: building Horovod $HVD for TensorFlow $TF ($OPS), about 4 minutes; cached in $CACHE"
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  "$BIN/pip" download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
      "horovod==$HVD" -d "$WORK" > "$WORK/download.log" 2>&1 ||
      { cat "$WORK/download.log" >&2; echo "build_horovod: cannot download the Horovod $HVD sdist from PyPI" >&2; exit 1; }
  tar -xzf "$WORK/horovod-$HVD.tar.gz" -C "$WORK"
  patch --quiet -p1 -d "$WORK/horovod-$HVD" < "$PATCH"
  MPI_FLAG=HOROVOD_WITHOUT_MPI
  if [ "$OPS" = gloo-mpi ]; then MPI_FLAG=HOROVOD_WITH_MPI; fi
  # --no-build-isolation: Horovod's CMake imports the installed TensorFlow.
  env HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
      HOROVOD_WITH_GLOO=1 HOROVOD_CPU_OPERATIONS=gloo "$MPI_FLAG=1" \
      MAKEFLAGS="-j$(nproc)" \
      "$BIN/pip" wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation \
      -w "$WORK/wheel" "$WORK/horovod-$HVD" > "$WORK/build.log" 2>&1 ||
      { tail -30 "$WORK/build.log" >&2; echo "build_horovod: the Horovod build failed (log above)" >&2; exit 1; }
  mkdir -p "$CACHE"
  mv "$WORK"/wheel/horovod-*.whl "$CACHE/"
fi
# Its dependencies are pinned in setup.cfg (the `horovod` extra), so --no-deps here.
"$BIN/pip" install --quiet --disable-pip-version-check --no-deps --force-reinstall "$CACHE"/horovod-*.whl
rm -f "$BIN"/../.horovod-*
touch "$BIN/../.horovod-$(basename "$CACHE")"
"$BIN/horovodrun" --check-build

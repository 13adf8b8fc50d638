#!/usr/bin/env bash
# tfdist on a Cloud TPU VM: create it, install tfdist with tensorflow-tpu on every worker, train
# on all workers with the same flags as locally, and delete it.
#
#   export TPU_NAME=tfdist-v4 ZONE=us-central2-b PROJECT=my-project ACCELERATOR=v4-8
#   export REPO=https://github.com/<you>/tfdist.git       # where the TPU VM clones tfdist from
#   launchers/tpu/tpu_vm.sh create
#   launchers/tpu/tpu_vm.sh install
#   launchers/tpu/tpu_vm.sh train -- --config=configs/gpt2.py --workdir=gs://my-bucket/runs/gpt2
#   launchers/tpu/tpu_vm.sh delete
#
# `train` runs `tfdist train --strategy=tpu <your flags>` on every worker of the TPU VM
# (--worker=all; a pod slice has several). Use a gs:// --workdir (and data_dir) on a pod: every
# path tfdist uses goes through tf.io.gfile. The TPU is found with --config.strategy.tpu=local.
# RUNTIME is the TPU VM software version; tensorflow-tpu comes from pip (TF_TPU_VERSION).
#
# Not run by the tests against real Cloud TPUs (there are none here): tests/test_tpu.py runs it
# with a stand-in gcloud that records the commands.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${PROJECT:?set PROJECT}"
ACCELERATOR=${ACCELERATOR:-v4-8}
RUNTIME=${RUNTIME:-tpu-ubuntu2204-base}
TF_TPU_VERSION=${TF_TPU_VERSION:-2.20.0}  # PyPI has no tensorflow-tpu 2.21 (checked 2026-11-22)
REPO=${REPO:-https://github.com/tfdist/tfdist.git}
GCLOUD=${GCLOUD:-gcloud}
tpu() { "$GCLOUD" compute tpus tpu-vm "$@" --zone="$ZONE" --project="$PROJECT"; }
on_all() { tpu ssh "$TPU_NAME" --worker=all --command="$1"; }

case "${1:-}" in
  create)
    tpu create "$TPU_NAME" --accelerator-type="$ACCELERATOR" --version="$RUNTIME" ;;
  install)
    # Python 3.11 venv; tfdist's pinned dependencies except tensorflow-cpu, then tensorflow-tpu
    # (with libtpu) in its place.
    on_all "set -e; sudo apt-get update -qq && sudo apt-get install -y -qq python3.11-venv git
      test -d tfdist || git clone $REPO tfdist; cd tfdist; git pull --ff-only
      python3.11 -m venv .venv; .venv/bin/pip install -q --upgrade pip
      .venv/bin/python launchers/tpu/requirements.py > /tmp/tfdist-requirements.txt
      .venv/bin/pip install -q -r /tmp/tfdist-requirements.txt
      .venv/bin/pip install -q tensorflow-tpu==$TF_TPU_VERSION -f https://storage.googleapis.com/libtpu-tf-releases/index.html
      .venv/bin/pip install -q --no-deps -e ." ;;
  train)
    shift; [ "${1:-}" = "--" ] && shift
    flags=$(printf ' %q' "$@")
    on_all "cd tfdist && .venv/bin/tfdist train --strategy=tpu --config.strategy.tpu=local$flags" ;;
  delete)
    tpu delete "$TPU_NAME" --quiet ;;
  *)
    echo "usage: $0 create|install|train -- <tfdist train flags>|delete" >&2; exit 2 ;;
esac

"""Prints tfdist's pinned dependencies from setup.cfg for a TPU VM (launchers/tpu/tpu_vm.sh
install): without tensorflow-cpu, which tensorflow-tpu replaces, nor tensorboard and protobuf,
which follow that TensorFlow. PyPI has no tensorflow-tpu 2.21 (newest 2.20.0, checked
2026-11-22), so a TPU VM runs TF 2.20 with its own tensorboard and protobuf."""
import configparser
import os

cfg = configparser.ConfigParser()
cfg.read(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "setup.cfg"))
for line in cfg["options"]["install_requires"].splitlines():
    line = line.strip()
    if line and not line.startswith(("#", "tensorflow-cpu", "tensorboard", "protobuf")):
        print(line)

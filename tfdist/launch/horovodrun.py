"""`python -m tfdist.launch.horovodrun ARGS`: Horovod's own `horovodrun ARGS`, whose build check
imports no TensorFlow (`tfdist.compat.horovod`: a row of the patch table). `tfdist launch
--strategy=horovod` does not use horovodrun (it starts the ranks itself); this is for a program
written for horovodrun (`tfdist.strategies.horovod.horovodrun_argv` builds its command line).

    python -m tfdist.launch.horovodrun -np 2 -H localhost:2 --gloo python train.py
"""
import sys

from tfdist import compat


def main():
    compat.patch_horovodrun()
    from horovod.runner.launch import run_commandline
    sys.argv[0] = "horovodrun"
    run_commandline()


if __name__ == "__main__":
    main()

"""Horovod for Keras 3: `tfdist.horovod.keras` is a drop-in for `horovod.tensorflow.keras`.

A Horovod Keras script runs correctly on Keras 3 by changing its import line:

    import tfdist.horovod.keras as hvd          # was: import horovod.tensorflow.keras as hvd
"""

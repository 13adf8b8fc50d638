"""The benchmarks' earlier command line, kept: `tools/bench.py [--scaling|--overlap|--pipeline]
FLAGS` runs the benchmark module of that mode with FLAGS (each mode is its own module now).

    python tools/bench.py                 -> tools/bench_step.py      (make bench)
    python tools/bench.py --scaling ...   -> tools/bench_scaling.py   (--ps, --horovod, --link)
    python tools/bench.py --overlap ...   -> tools/bench_overlap.py
    python tools/bench.py --pipeline ...  -> tools/bench_pipeline.py
"""
import os
import runpy
import sys

MODES = {"--scaling": "bench_scaling", "--overlap": "bench_overlap", "--pipeline": "bench_pipeline"}

if __name__ == "__main__":
    module = next((m for flag, m in MODES.items() if flag in sys.argv[1:]), "bench_step")
    sys.argv = [sys.argv[0]] + [a for a in sys.argv[1:] if a not in MODES]
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), module + ".py"),
                   run_name="__main__")

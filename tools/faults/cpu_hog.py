"""Keeps CPU cores busy, to check that the test suite passes on a loaded machine.

    python tools/faults/cpu_hog.py --cores 1 &        # one core of this 2-core machine busy
    make test; make test                       # the suite, twice, under that load
    kill %1

Each core gets a process spinning in pure Python at normal priority until the hog is stopped
(SIGTERM/SIGINT, or --seconds).
"""
import argparse
import multiprocessing
import os
import signal
import sys
import time


def spin(deadline):
    x = 0
    while deadline is None or time.monotonic() < deadline:
        for _ in range(100_000):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cores", type=int, default=1, help="busy processes (default 1)")
    ap.add_argument("--seconds", type=float, default=0,
                    help="stop after this long (0: until killed)")
    args = ap.parse_args()
    if not 1 <= args.cores <= (os.cpu_count() or 1):
        print(f"cpu_hog: error: --cores must be in [1, {os.cpu_count()}], got {args.cores}",
              file=sys.stderr)
        sys.exit(2)
    deadline = time.monotonic() + args.seconds if args.seconds else None
    procs = [multiprocessing.Process(target=spin, args=(deadline,), daemon=True)
             for _ in range(args.cores)]
    for p in procs:
        p.start()
    print(f"cpu_hog: {args.cores} busy process(es): pids {' '.join(str(p.pid) for p in procs)}",
          flush=True)

    def stop(signum, frame):
        for p in procs:
            p.terminate()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()

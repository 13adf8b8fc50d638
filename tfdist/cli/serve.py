"""`python -m tfdist.cli.serve <strategy>`: a server task of a strategy that has them (the
parameter server's worker and ps tasks), for a user's own program under `tfdist launch`: the
program runs on the chief only, and these tasks only serve. Building the plugin on a server task
serves until the chief is gone, then ends the process (`Strategy.serve`).

    TF_CONFIG='{...,"task":{"type":"ps","index":0}}' python -m tfdist.cli.serve parameter_server
"""
import sys

from tfdist import cli, strategies


def main(argv):
    if len(argv) != 2:
        from tfdist.errors import UsageError
        raise UsageError("give the strategy: python -m tfdist.cli.serve <strategy>")
    strategies.get(argv[1])  # serves, then ends the process (a chief's would return)


if __name__ == "__main__":
    cli.run(main, sys.argv)

"""`tfdist <command> [flags]`: prepare, train, sample, export, launch, plan."""
import importlib
import sys

#: each command's command line: tfdist/cli/<command>.py
_NAMES = ("prepare", "train", "sample", "export", "launch", "plan")
COMMANDS = {name: f"tfdist.cli.{name}" for name in _NAMES}
USAGE = (f"usage: tfdist {{{','.join(_NAMES)}}} [--flags]   (tfdist <command> --help "
         "for its flags)")


def main(argv=None):
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if len(argv) >= 2 else 2)
    if argv[1] not in COMMANDS:
        print(f"tfdist: error: unknown command '{argv[1]}'; {USAGE}", file=sys.stderr)
        sys.exit(2)
    if argv[1] == "launch":  # its agent: a fork of this process, where it has TF imported (made
        from tfdist.launch.warm import keep_a_fork  # before the command's flags are defined)
        keep_a_fork()
    module = importlib.import_module(COMMANDS[argv[1]])  # (no TensorFlow yet: `--help` is quick)
    module.run([f"tfdist {argv[1]}"] + argv[2:])


if __name__ == "__main__":
    main()

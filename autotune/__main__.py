"""`python -m autotune` and the `autotune` command (pyproject's entry point is `run`)."""

import sys


def run() -> int:
    # The command line is imported here, not at the top: a Ctrl-C in its first milliseconds, while
    # it imports, is "interrupted" too, not a traceback (cli.main covers everything after).
    try:
        from .cli import main
    except KeyboardInterrupt:
        print("autotune: interrupted", file=sys.stderr)
        return 130  # cli.EXIT_INTERRUPTED, which did not get imported
    return main()


if __name__ == "__main__":
    sys.exit(run())

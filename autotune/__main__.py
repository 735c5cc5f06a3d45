"""`python -m autotune` and the `autotune` command (pyproject's entry point is `run`)."""

import sys


def run() -> int:
    # The command line is imported here, not at the top: a Ctrl-C in its first milliseconds, while
    # it imports, is "interrupted" too, not a traceback (cli.main covers everything after).
    try:
        from .cli import EXIT_INTERRUPTED, main, stop_signals_exit_with
    except KeyboardInterrupt:
        print("autotune: interrupted", file=sys.stderr)
        return 130  # cli.EXIT_INTERRUPTED, which did not get imported
    try:
        code = main()
    except KeyboardInterrupt:  # a stop signal after main's own handling, before its return
        print("autotune: interrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    except SystemExit as exc:  # argparse's usage errors (2) and --help (0), said already
        stop_signals_exit_with(exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1)
        raise
    stop_signals_exit_with(code)  # from here to the interpreter's end, a stop signal ends it so
    return code


if __name__ == "__main__":
    sys.exit(run())

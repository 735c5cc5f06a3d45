"""What every benchmark script does around its main(), as autotune's own command does: bad input
(an unknown model, a size that is not one) is one line and exit 1, not a traceback; Ctrl-C, or
SIGTERM from `timeout`, stops the running trial with its process group, removes the script's
temporary folders (SIGTERM at its default ended the script at once and left them in /tmp), says
what was kept, and exits 130."""

import sys


def run(main, kept: str = "") -> None:
    """`kept`: what an interrupted run leaves for the user, said after "interrupted"."""
    from autotune.cli import stop_signals_exit_with, terminate_as_interrupt
    from autotune.errors import AutotuneError

    terminate_as_interrupt()
    try:
        result = main()
    except AutotuneError as exc:
        stop_signals_exit_with(1)
        sys.exit(f"{sys.argv[0]}: error: {exc}")
    except KeyboardInterrupt:  # the context managers have cleaned up by now
        # a later signal (`timeout` signals the script, then its group) ends it with this code
        stop_signals_exit_with(130)
        print(f"{sys.argv[0]}: interrupted{': ' + kept if kept else ''}", file=sys.stderr)
        sys.exit(130)
    stop_signals_exit_with(result if isinstance(result, int) else 0 if result is None else 1)
    sys.exit(result)

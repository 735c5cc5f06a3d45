"""What the benchmark scripts do around their main(), as autotune's own command does: bad input
(an unknown model, a size that is not one) is one line and exit 1, not a traceback; Ctrl-C, or
SIGTERM from `timeout`, stops the running trial with its process group and removes the script's
temporary folders (SIGTERM at its default ended the script at once and left them in /tmp)."""

import sys


def run(main) -> None:
    from autotune.cli import terminate_as_interrupt
    from autotune.errors import AutotuneError

    terminate_as_interrupt()
    try:
        result = main()
    except AutotuneError as exc:
        sys.exit(f"{sys.argv[0]}: error: {exc}")
    except KeyboardInterrupt:
        sys.exit(f"{sys.argv[0]}: interrupted")  # the context managers have cleaned up by now
    sys.exit(result)

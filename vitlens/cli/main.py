"""``vitlens`` (and ``python -m vitlens``): parse, run the command, and turn what went wrong into one line on stderr
(exit 2 for bad input, 1 for an unexpected error, 130 when interrupted; a traceback only with --debug)."""
from __future__ import annotations

import errno
import sys
from typing import Sequence

from vitlens.words import printable

from .common import CliError, EXIT_ERROR, EXIT_USAGE, Interrupted
from .parser import build_parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "model", "unset") is None:
        args.model = ["ref-vit"]
    from vitlens.errors import VitlensError

    try:
        return args.func(args)
    except (CliError, VitlensError) as e:
        if args.debug:
            raise
        text = e.message_for("cli") if isinstance(e, VitlensError) else str(e)
        print(printable(f"vitlens: error: {text}", newlines=True), file=sys.stderr)
        return EXIT_USAGE
    except Interrupted as e:
        print(printable(f"vitlens: interrupted; {e}"), file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("vitlens: interrupted; nothing was written.", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:  # a full disk is the machine's state, not a bug
            where = e.filename or getattr(args, "out", None) or "the output folder"
            print(f"vitlens: error: no space left on device at {where}; free some space or write elsewhere "
                  "(--out), then rerun.", file=sys.stderr)
            return EXIT_ERROR
        print(printable(f"vitlens: unexpected error ({type(e).__name__}: {e}); rerun with --debug for the traceback."),
              file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["main"]

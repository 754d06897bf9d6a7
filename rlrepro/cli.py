"""The ``rlrepro`` command line (filled in as the subcommands land)."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    print("usage: rlrepro {train,diff,verify,plot,generate} ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""The fork server's process (specd.tools.forkserver): what every service loads, loaded once, then forks.

    python -m specd.tools.fork_template FD   # FD: its end of the socket pair to the client

It imports the CLI the way `specd.tools.entry` does (the environment's defaults first), starts no
thread, channel, OpenMP pool or CUDA context, and runs each requested service in a fork as
`specd.tools.entry.main(argv)`, the entry point a fresh interpreter would run.
"""

from __future__ import annotations

import sys

from specd.tools import entry
from specd.tools.forkserver import serve


def main(fd: int) -> None:
    entry.load_cli()
    serve(fd, entry.main)


if __name__ == "__main__":
    main(int(sys.argv[1]))

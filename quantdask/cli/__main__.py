"""``python -m quantdask.cli``: the ``quantdask`` command."""

import sys

from quantdask.cli.main import main

if __name__ == "__main__":  # not again in a process that imports it (multiprocessing spawn)
    sys.exit(main())

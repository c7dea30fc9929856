"""``python -m mmrl ...``: the same as the ``mmrl`` command (:func:`mmrl.cli.main`)."""

import sys

from mmrl.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m dsa_dcp``: the ``dsa-dcp`` command line."""

import sys

from dsa_dcp.cli import main

if __name__ == "__main__":
    sys.exit(main())

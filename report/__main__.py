"""`python -m report`: the command line (report/cli.py)."""

import sys

from report.cli import main

sys.exit(main(sys.argv[1:]))

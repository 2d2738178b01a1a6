"""``python -m testbed``: the test bed's command line (:mod:`testbed.cli`)."""
import sys

from testbed import cli

sys.exit(cli.main())

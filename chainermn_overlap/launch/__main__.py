"""``python -m chainermn_overlap.launch``: see the package docstring."""
import sys

from chainermn_overlap.launch.cli import main

sys.exit(main())

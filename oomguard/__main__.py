"""`python -m oomguard`: the command line (oomguard.cli)."""

import sys

from oomguard.cli import main

sys.exit(main())

"""`python -m oomguard`: the command line (oomguard.cli.main)."""

import sys

from oomguard.cli.main import main

sys.exit(main())

"""`python -m dsinfer …` runs the `dsinfer` command line."""

import sys

from dsinfer.cli import main

sys.exit(main())

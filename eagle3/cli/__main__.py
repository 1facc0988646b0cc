"""`python -m eagle3.cli`: the `eagle3` command without its console script."""

import sys

from eagle3.cli.command import main

sys.exit(main())

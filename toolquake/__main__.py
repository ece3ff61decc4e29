"""`python -m toolquake` is the `toolquake` command."""

import sys

from toolquake.proxy.cli import main

sys.exit(main())

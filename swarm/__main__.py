"""`python -m swarm` runs `swarm-peer`."""

import sys

from swarm.cli.peer import main

sys.exit(main())

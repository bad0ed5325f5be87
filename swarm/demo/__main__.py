"""`python -m swarm.demo`: runs the local swarm demo (see `swarm.demo.launcher`)."""

import sys

from swarm.demo.launcher import main

sys.exit(main())

"""The client side of mixture-of-experts: `RemoteExpert` (one expert served elsewhere), the
mixture layers (`mixture`, `switch`) that route each sample to its best live experts found by
beam search (`beam_search`), and the plan (`jobs`) and calls (`dispatch`) of one batch.

See docs/architecture.md, "Life of a mixture forward".
"""

import swarm.core.needs_torch  # noqa: F401  (first: without torch, an error naming the install command)

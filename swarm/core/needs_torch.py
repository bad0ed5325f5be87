"""Imported first by each package that needs torch (averaging, compression, moe.client, optim, demo).

Without torch, importing one of them raises `MissingDependency` naming the install command
(`swarm.core.optional.TORCH_INSTALL`) rather than a bare "No module named 'torch'".
"""

from swarm.core.optional import require_torch

require_torch("this part of swarm (averaging, compression, experts, the optimizer, the demo)")

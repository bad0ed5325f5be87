"""The demo: a local swarm (an expert server and a few trainers) trains a byte-level language model.

`python -m swarm.demo` runs it (`launcher`); `python -m swarm.demo.trainer` is one trainer, which
also joins a remote swarm with `--initial-peers`. The model (`model`) is a small transformer whose
middle layer is a `swarm.RemoteMixtureOfExperts`; its text (`data`) ships with Python.
"""

import swarm.core.needs_torch  # noqa: F401  (first: without torch, an error naming the install command)

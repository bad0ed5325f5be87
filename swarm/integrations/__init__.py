"""Training loops users already have, in a swarm: transformers' `Trainer`, PyTorch Lightning, accelerate.

Each integration lives in its own module behind an optional extra, and nothing here is imported by
`import swarm`:

- `swarm.integrations.transformers` (`pip install 'swarm-peer[transformers]'`): `SwarmTrainer`;
- `swarm.integrations.lightning` (`pip install 'swarm-peer[lightning]'`): `SwarmStrategy`;
- `swarm.integrations.session`: what both share and what a plain or accelerate loop uses
  (`SwarmArguments`, `SwarmSession`); `swarm.integrations.data`: `PeerShardSampler`;
  `swarm.integrations.fingerprint`: the model check that keeps another model out of a run.

docs/integrations.md says which of each framework's settings mean what in a swarm.
"""

"""`swarm-peer export`: a model's parameters out of a run's checkpoint, or out of a live run, into
one safetensors file (docs/operations.md, "Checkpoints and a cold restart").

    swarm-peer export --checkpoint DIR [--epoch N] [--run RUN_ID] --out model.safetensors
    swarm-peer export --run RUN_ID --initial-peers MADDR... --out model.safetensors
    swarm-peer export (--checkpoint DIR | --run ...) --transformers CONFIG --out DIR

With ``--transformers`` (a run made with the transformers integration; CONFIG is the model's
``config.json`` or a directory holding it) ``--out`` is a directory that ``from_pretrained``
loads (`swarm.optim.pretrained`).

From a checkpoint, the parameters keep the names they were saved under (a trainer that passed its
model's ``named_parameters()`` names gets a file ``model.load_state_dict`` takes as it is) and the
export needs no torch. From a live run, a client-mode peer downloads the state through the run's
state transfer from a peer at the newest epoch whose state fingerprint most peers at that epoch
report (a provider whose state differs is refused); the parameters are then named ``param.<i>``
in the optimizer's order. Either way the file is written under a temporary name, fsynced and
renamed. Exit status: 0 written, 1 nothing usable found, 2 bad options.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from swarm.checkpoint import CheckpointStore, RawTensor, RunCheckpointError
from swarm.checkpoint.format import MANIFEST_FILE, write_safetensors
from swarm.checkpoint.store import Checkpoint, load_checkpoint
from swarm.core.errors import SwarmError

logger = logging.getLogger("swarm.cli.export")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-peer export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a directory of a run's checkpoints, or one checkpoint's directory")
    parser.add_argument("--epoch", type=int, default=None, help="which checkpoint (default: the newest intact one)")
    parser.add_argument("--run", default=None, help="the run (refuses another run's checkpoint; needed for a live run)")
    parser.add_argument("--initial-peers", nargs="+", default=[], help="a live run: peers of its swarm")
    parser.add_argument("--timeout", type=float, default=120.0, help="a live run: seconds for the download")
    parser.add_argument("--out", type=Path, required=True,
                        help="the safetensors file to write (with --transformers: the directory)")
    parser.add_argument("--transformers", type=Path, default=None, metavar="CONFIG",
                        help="the model's config.json (or a directory holding it): write a from_pretrained directory")
    parser.add_argument("--log-level", default="WARNING")
    return parser


def from_checkpoint(path: Path, epoch: int | None, run_id: str | None) -> Checkpoint:
    """The checkpoint to export: `path` itself if it is one, else the store's `epoch` or newest intact one."""
    if (path / MANIFEST_FILE).exists():
        return load_checkpoint(path, run_id)
    store = CheckpointStore(path)
    return store.load(epoch, run_id) if epoch is not None else store.load_newest(run_id)


def write_params(out: Path, params: Sequence[tuple[str, RawTensor]], run_id: str, epoch: int) -> int:
    """Writes the parameters to `out` atomically; returns its size in bytes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        digest = write_safetensors(tmp, params, {"format": "pt", "run_id": run_id, "epoch": str(epoch)})
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return digest.size


def from_live_run(run_id: str, initial_peers: Sequence[str], timeout: float) -> tuple[int, list[tuple[str, RawTensor]]]:
    """Downloads the state of a live run as a client-mode peer: (epoch, parameters named ``param.<i>``)."""
    from swarm.optim.checkpointing import to_raw
    from swarm.optim.live_state import download_live_state
    from swarm.peer import Peer

    with Peer(initial_peers=list(initial_peers), client_mode=True) as peer:
        state = peer.run(download_live_state(peer, run_id, timeout), timeout=timeout + 10)
    return state.epoch, [(f"param.{i}", to_raw(p)) for i, p in enumerate(state.params)]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (args.checkpoint is None) == (not args.initial_peers):
        print("swarm-peer export: error: give --checkpoint DIR, or --run RUN_ID with --initial-peers",
              file=sys.stderr)
        return 2
    try:
        if args.checkpoint is not None:
            checkpoint = from_checkpoint(args.checkpoint, args.epoch, args.run)
            run_id, epoch = checkpoint.manifest.run_id, checkpoint.epoch
            params = [(spec.name, t) for spec, t in zip(checkpoint.manifest.params, checkpoint.params)]
        else:
            if not args.run:
                print("swarm-peer export: error: a live run's export needs --run RUN_ID", file=sys.stderr)
                return 2
            run_id = args.run
            epoch, params = from_live_run(run_id, args.initial_peers, args.timeout)
        if args.transformers is not None:
            from swarm.optim.pretrained import WEIGHTS_FILE, copy_config, pretrained_params

            named = pretrained_params(params, args.transformers)
            args.out.mkdir(parents=True, exist_ok=True)
            size = write_params(args.out / WEIGHTS_FILE, named, run_id, epoch)
            copy_config(args.transformers, args.out)
        else:
            size = write_params(args.out, params, run_id, epoch)
    except (RunCheckpointError, SwarmError, TimeoutError) as e:
        print(f"swarm-peer export: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"swarm-peer export: error: cannot write {args.out}: {e}", file=sys.stderr)
        return 1
    print(f"exported {len(params)} parameters ({size / 1e6:.1f} MB) of run {run_id!r} at epoch {epoch} "
          f"to {args.out}", flush=True)
    return 0

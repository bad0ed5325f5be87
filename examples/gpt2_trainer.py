"""Three local peers train one GPT-2-architecture model with transformers' Trainer, in a swarm.

    python examples/gpt2_trainer.py [--steps 60] [--diloco]

Each peer is an ordinary `Trainer` script with two changes: `SwarmTrainer` in place of `Trainer`, and
`swarm=SwarmArguments(...)`. The three run as threads of this process, on loopback; on three
machines, run the same script on each with `SWARM_INITIAL_PEERS` set to an address the first prints.
The model is random-initialized from a `GPT2Config`, the corpus built with `datasets` from the text
that ships with Python (`gpt2_common.py`): nothing is downloaded. It prints the held-out loss as the
swarm's step count grows.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from gpt2_common import HeldOutPrinter, byte_corpus, example_arguments, local_peers, tiny_gpt2, train_together
from transformers import TrainerCallback, TrainingArguments

from swarm.integrations.session import SwarmArguments
from swarm.integrations.transformers import SwarmTrainer
from swarm.optim import DiLoCoConfig


class PrintHeldOutLoss(TrainerCallback):
    def __init__(self, printer: HeldOutPrinter) -> None:
        self.printer = printer

    def on_step_end(self, args, state, control, **kwargs):
        self.printer.at_step(state.global_step)


def main(argv: Sequence[str] | None = None) -> list[float]:
    """Runs the example; returns the held-out losses it printed."""
    args = example_arguments(__doc__.splitlines()[0], argv, lambda parser: parser.add_argument(
        "--diloco", action="store_true", help="DiLoCo mode (8 local steps per round)"))
    train, held_out = byte_corpus(64, limit=args.limit)
    peers = local_peers(args.peers)
    swarm = SwarmArguments(run_id="gpt2-trainer", target_batch_size=None if args.diloco else 32 * args.peers,
                           diloco=DiLoCoConfig(local_steps=8) if args.diloco else None, min_peers=args.peers)
    out = tempfile.mkdtemp(prefix="gpt2-trainer-")
    trainers = []
    for i, peer in enumerate(peers):
        model = tiny_gpt2(context=64)
        training = TrainingArguments(output_dir=f"{out}/peer{i}", per_device_train_batch_size=16,
                                     gradient_accumulation_steps=2, max_steps=args.steps, learning_rate=2e-3,
                                     lr_scheduler_type="cosine", warmup_steps=5, max_grad_norm=1.0,
                                     save_steps=10_000, report_to=[], use_cpu=True, disable_tqdm=True,
                                     logging_steps=10_000)
        trainer = SwarmTrainer(model=model, args=training, train_dataset=train, swarm=swarm, peer=peer)
        if i == 0:
            printer = HeldOutPrinter(model, held_out, args.steps // 6)
            trainer.add_callback(PrintHeldOutLoss(printer))
        trainers.append(trainer)
    train_together(peers, [t.train for t in trainers])
    return printer.losses


if __name__ == "__main__":
    main()

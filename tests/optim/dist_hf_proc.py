"""transformers' `SwarmTrainer` on the examples' tiny GPT-2, as a peer of its own or, under `torchrun`,
as the ranks of one peer (the Trainer starts gloo; the swarm sees rank 0's peer only).

    python dist_hf_proc.py --out DIR --name N --steps S                       # prints its address first
    torchrun --nproc-per-node 2 dist_hf_proc.py --out DIR --name N --steps S --initial-peers MADDR

The command line and the log each rank writes: `dist_steps.py`.
"""

from __future__ import annotations

from dist_steps import BATCH, Worker, parse_args
from gpt2_common import tiny_gpt2
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from swarm.integrations.transformers import SwarmTrainer


def main() -> None:
    args = parse_args()
    worker = Worker(args, "hf-job")
    holder: dict[str, SwarmTrainer] = {}

    class Record(TrainerCallback):
        def on_step_end(self, a: TrainingArguments, state: TrainerState, control: TrainerControl,
                        **kwargs: object) -> None:
            session = holder["trainer"].session
            assert session is not None
            worker.step(session.optimizer, BATCH)

        def on_train_end(self, a: TrainingArguments, state: TrainerState, control: TrainerControl,
                         **kwargs: object) -> None:
            trainer = holder["trainer"]
            assert trainer.session is not None and trainer._sampler is not None
            # the round in flight landed (SwarmTrainer's flush ran first)
            worker.end(trainer.session.optimizer, position=trainer._sampler.position,
                       global_zero=trainer.is_world_process_zero())

    training = TrainingArguments(
        output_dir=str(worker.checkpoints), per_device_train_batch_size=BATCH, max_steps=args.steps,
        learning_rate=3e-3, report_to=[], use_cpu=True, disable_tqdm=True,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        dataloader_num_workers=0, logging_steps=1000)
    trainer = SwarmTrainer(model=tiny_gpt2(context=32), args=training, train_dataset=worker.train, swarm=worker.swarm,
                           peer=worker.peer, callbacks=[Record()])
    holder["trainer"] = trainer
    trainer.train(resume_from_checkpoint=args.resume)
    worker.finish()


if __name__ == "__main__":
    main()

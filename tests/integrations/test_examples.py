"""The GPT-2 examples, run as a user runs them (their `main`, in a short mode): the held-out loss falls."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the transformers extra is not installed")
pytest.importorskip("datasets", reason="the transformers extra is not installed")

pytestmark = pytest.mark.alone  # three peers average in this process against round deadlines

# 4 of the swarm's steps on the corpus's first 150 kB: the same code as the default 60 steps
SHORT = ["--steps", "4", "--limit", "150000"]


def test_the_trainer_example_prints_a_falling_held_out_loss(capsys):
    import gpt2_trainer

    losses = gpt2_trainer.main(SHORT)
    assert len(losses) >= 3 and losses[-1] < losses[0] - 0.2, losses  # the swarm's step can move by 2
    assert "swarm step    4  held-out loss" in capsys.readouterr().out  # max_steps counted the swarm's steps


def test_the_lightning_example_prints_a_falling_held_out_loss(capsys):
    pytest.importorskip("lightning.pytorch", reason="the lightning extra is not installed")
    import gpt2_lightning

    losses = gpt2_lightning.main(SHORT)
    assert len(losses) >= 3 and losses[-1] < losses[0] - 0.2, losses  # the swarm's step can move by 2
    assert "swarm step    4  held-out loss" in capsys.readouterr().out  # max_steps counted the swarm's steps

"""The server side of mixture-of-experts: `ExpertServer` (`expert_server`) hosts experts on a
peer. Requests are checked (`admission`), queued in task pools (`task_pool`), merged into batches
and run on compute threads (`runtime`, `batch_runner`) by each expert's backend (`backend`,
`hosted`); forward passes are kept for the backward call that follows (`saved_graphs`); experts
are saved (`checkpoints`). `experts` holds the expert classes a server can host by name, and
`cli` is ``swarm-peer --experts``.
"""

"""Learner side of asyncrl: batches of trajectories -> log-probs -> loss -> optimizer step.

``asyncrl.learners.batching`` pads trajectories into batches and scores their token log-probs; the
maths lives in the registries below, all pure torch functions. Nothing heavy is imported here, so
``import asyncrl.learners`` stays cheap; DeepSpeed is imported only by the learner process itself.

The algorithm pieces users switch between, each a registry of pure functions with slow-reference tests
(docs/algorithms.md): ``advantages`` (ADVANTAGES), ``policy_losses`` (POLICY_LOSSES, AGGREGATIONS and the
PPO critic loss), ``kl`` (KL_ESTIMATORS) and ``corrections`` (CORRECTIONS). Their names, parameters and
the presets (a name expanding to one piece of each kind plus defaults) are torch-free config:
``asyncrl.config.pieces`` and ``asyncrl.config.presets``. ``objective`` composes a preset's pieces into
one step's losses (split-invariant over ranks); ``models`` builds the reference model and the critic;
``peak_memory`` keeps a rank's peak memory down (activation checkpointing, gradients added in place);
``vision``: a vision-language policy's pixel inputs per batch row and the names each version carries;
``records``: a step's metric sums and its ``metrics.jsonl`` record.

A learner rank's process: ``trainer`` (``python -m asyncrl.learners.trainer``), its loop from start-up to the
final commit; ``train_step``, one step of its models (forward, losses, backward, optimizer steps);
``deepspeed_engine``, the DeepSpeed engine around a model, the rank's process group, checkpoints and HF export.

May import: the core, asyncrl.buffers, asyncrl.weights, asyncrl.observe, asyncrl.models.
"""

"""Watching a run: metrics, status, plots and the weight-sync probe.

* ``metrics``: the metrics sinks (JSONL, TensorBoard, W&B, Redis) and the one logging setup;
  ``tensorboard``: event files without TensorFlow.
* ``status``: ``asyncrl status``, a snapshot read from the run's Redis (live, or its append-only file).
* ``plot``: ``asyncrl plot``, one PNG dashboard of one or more runs.
* ``probe``: the weight-sync probe (does a generator's engine compute what the learner computes?).

May import: the core, asyncrl.buffers, asyncrl.fleet.
"""

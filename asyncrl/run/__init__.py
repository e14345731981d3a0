"""Launching and supervising a run: every way a run starts, and what keeps it alive.

* ``launch``: ``asyncrl launch`` on one machine (redis-server, learner ranks, generators as OS processes),
  the only writer of the run directory; ``stats``: its metrics, summary and progress line.
* ``ray_backend``: ``asyncrl launch --backend ray``; ``slurm``, ``slurm_scripts``: ``asyncrl slurm``.
* ``join``: ``asyncrl generator | learner | redis``, one process joining a running job from anywhere.
* ``preflight``: what is checked before anything starts (``--dry-run``), a vision-language run's in
  ``vision_checks``; ``resume``: ``--resume``.
* ``gpus``: which GPU each process of a local launch gets, and the layouts NCCL refuses.
* ``forkserver``: a local launch's generators forked from one process that imported their modules once.
* ``disk``: a full disk ends a run in one line with its summary, and the next checkpoint's room is
  watched; ``samples``: the rotating ``samples.jsonl`` of rendered prompts and completions.

A new way to launch goes here, beside ``launch`` and ``ray_backend``.

May import: the core, asyncrl.buffers, asyncrl.weights, asyncrl.models, asyncrl.fleet, asyncrl.observe,
asyncrl.learners, asyncrl.rewards, asyncrl.episodes, asyncrl.generators, asyncrl.demo.
"""

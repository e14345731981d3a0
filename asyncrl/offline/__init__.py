"""The offline training modes: ``asyncrl sft``, ``asyncrl rm`` and ``asyncrl dpo``.

* ``launch``: the commands (check config, model and examples, start the ranks); ``data``: their examples,
  checked and tokenized; ``train``: one rank, on the RL learner's DeepSpeed engine. Their config section
  is ``asyncrl.config.offline``.

May import: the core, asyncrl.learners, asyncrl.rewards, asyncrl.models, asyncrl.observe, asyncrl.run.
"""

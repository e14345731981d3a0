"""Learner side of asyncrl: batches of trajectories -> log-probs -> loss -> optimizer step.

``asyncrl.learners.loss`` holds the maths (advantages, the GRPO loss with truncated importance
sampling, padding and token log-probs) as pure torch functions. Nothing heavy is imported here, so
``import asyncrl.learners`` stays cheap; DeepSpeed is imported only by the learner process itself.
"""

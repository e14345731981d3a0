"""asyncrl: asynchronous RL for language models.

The house, one room per concern (each package's docstring says what lives there and what it may import;
``tests/core/test_house.py`` holds every package to it and finds no import circle):

* the core, at this level: ``config/`` (every section, the algorithm menu, the root ``Config``),
  ``protocol`` (wire formats), ``staleness`` (the lag contract), ``errors``, ``keys`` and ``control`` (the
  run's Redis keys and coordination), ``secret``, ``net``, ``chat`` (token ids of a conversation), ``data``
  (datasets, user code by import path), ``rundir`` and ``lifetime`` (the run directory, processes that die
  with their launcher) and ``cli``. The core imports no wing.
* the three roles, installed from the repository's own folders (``pyproject.toml``'s package-dir):
  ``asyncrl.generators`` is ``generators/``, ``asyncrl.learners`` is ``learners/``, ``asyncrl.buffers`` is
  ``buffers/``.
* the wings: ``weights/`` (the weight bus), ``service/`` (the kit every server and worker pool is built from:
  killable worker processes, JSON over HTTP, the retrying client, the sandbox), ``episodes/`` (the episode API,
  its kinds, tools), ``gateway/`` (the OpenAI-compatible endpoint agents play episodes through), ``rewards/``
  (every reward source), ``run/`` (launch, Ray, SLURM, joining, resume), ``fleet/`` (rendezvous, redis-server),
  ``observe/`` (metrics, status, plots), ``offline/`` (sft, rm, dpo), ``models/`` (recipes, GGUF) and
  ``demo/`` (the embedded demos).

Heavy dependencies (vllm, deepspeed, torch) are imported only inside generators, learners and the
launcher's children, so ``import asyncrl`` and ``asyncrl --help`` stay fast.

Modules that moved keep their old import paths for configs and user code written against them
(``data.reward: asyncrl.math_reward:math_reward``, ``from asyncrl.tools import tool``): importing an old
path gives the module at its new one, with a FutureWarning naming it.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__version__ = "0.1.0"

# old module path -> where it lives now
MOVED_MODULES = {
    "asyncrl.tools": "asyncrl.episodes.tools",
    "asyncrl.remote_reward": "asyncrl.rewards.remote",
    "asyncrl.reward_serve": "asyncrl.rewards.serve",
    "asyncrl.math_reward": "asyncrl.rewards.math_answer",
    "asyncrl.reward_model": "asyncrl.rewards.model",
    "asyncrl.launch": "asyncrl.run.launch",
    "asyncrl.preflight": "asyncrl.run.preflight",
    "asyncrl.resume": "asyncrl.run.resume",
    "asyncrl.run_stats": "asyncrl.run.stats",
    "asyncrl.ray_backend": "asyncrl.run.ray_backend",
    "asyncrl.slurm": "asyncrl.run.slurm",
    "asyncrl.slurm_scripts": "asyncrl.run.slurm_scripts",
    "asyncrl.redis_server": "asyncrl.fleet.redis_server",
    "asyncrl.retry": "asyncrl.net",
    "asyncrl.sections": "asyncrl.config",
    "asyncrl.offline_config": "asyncrl.config.offline",
    "asyncrl.offline_data": "asyncrl.offline.data",
    "asyncrl.offline_launch": "asyncrl.offline.launch",
    "asyncrl.metrics": "asyncrl.observe.metrics",
    "asyncrl.status": "asyncrl.observe.status",
    "asyncrl.plot": "asyncrl.observe.plot",
    "asyncrl.tensorboard": "asyncrl.observe.tensorboard",
    "asyncrl.probe": "asyncrl.observe.probe",
    "asyncrl.gguf_model": "asyncrl.models.gguf",
    "asyncrl.smollm2": "asyncrl.models.smollm2",
    "asyncrl.learners.pieces": "asyncrl.config.pieces",
    "asyncrl.learners.presets": "asyncrl.config.presets",
    "asyncrl.learners.offline": "asyncrl.offline.train",
    "asyncrl.episodes.pool": "asyncrl.service.pool",
    "asyncrl.episodes.pool_sessions": "asyncrl.service.sessions",
    "asyncrl.episodes.pool_worker": "asyncrl.service.pool_worker",
    "asyncrl.episodes.openai_server": "asyncrl.gateway.server",
    "asyncrl.episodes.openai_wire": "asyncrl.gateway.wire",
    "asyncrl.episodes.transcript": "asyncrl.gateway.transcript",
    "asyncrl.episodes.agent": "asyncrl.gateway.agent",
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as the module at its new one (the same module object, not a copy)."""

    def find_spec(self, name, path=None, target=None):
        if name not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return None  # a blank module, replaced in exec_module

    def exec_module(self, module) -> None:
        new = MOVED_MODULES[module.__name__]
        warnings.warn(f"{module.__name__} is now {new}: update the import path", FutureWarning, stacklevel=2)
        # the import system reads sys.modules back after exec_module, so the importer gets the real module
        sys.modules[module.__name__] = importlib.import_module(new)


sys.meta_path.append(_Moved())

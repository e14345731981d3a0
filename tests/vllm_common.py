"""What every test that starts a vLLM engine in the pytest process shares. The worker extension: vLLM mixes
the extension class into its worker CLASS (process-wide) at the first engine's start, and a later engine with
another extension class fails its start on the first attribute they share; so all of them take this one. And
:func:`fresh_parallel_state`: vLLM makes its process groups once per process, at the first engine's start,
the expert-parallel one only for a mixture of experts; a later MoE engine then fails its start ("expert
parallel group is not initialized") after a dense one (a generator process only ever starts one engine)."""

from __future__ import annotations

import torch

from asyncrl.generators.vllm_engine import WeightReloadExtension


class PlainParamsExtension(WeightReloadExtension):
    """The product's worker extension plus a read-back of the parameters vLLM holds as plain tensors
    (embeddings, norms, head, and the linear layers that run ``F.linear`` after a direct reload). On CPU the
    other linear layers' weights live in opaque prepacked oneDNN handles and read back as empty."""

    def asyncrl_plain_params(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.model_runner.get_model().named_parameters() if p.numel()}


def fresh_parallel_state() -> None:
    """Drop the process groups an earlier engine in this process made, so the next engine makes its own."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


def start_engine(model_dir, max_num_seqs: int = 8, dtype: str = "float32", routes: bool = False):
    """A real vLLM engine in this process on ``model_dir`` (the test extension, its KV cache sized as a
    generator's, the process groups of any earlier engine dropped first); ``routes``: rollout routing replay's
    capture on."""
    from asyncrl.config import load_config
    from asyncrl.generators.vllm_engine import VllmEngine

    overrides = {"model.path": str(model_dir), "model.recipe": None, "model.dtype": dtype}
    cfg = load_config(None, {**overrides, "generator.engine.type": "vllm"})
    fresh_parallel_state()
    return VllmEngine(
        cfg.generator.engine, cfg.model, max_num_seqs, seed=0, extension=PlainParamsExtension, routes=routes
    )

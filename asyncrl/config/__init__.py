"""Run configuration: one pydantic section per component, composed by the root ``Config``.

Lives here: the base every section shares (``base``), one module per section, named after the component
that owns it (``run``, ``model``, ``data``, ``buffer``, ``generator``, ``episode``, ``learner``,
``algorithm``, ``weights``; ``offline`` for ``asyncrl sft | rm | dpo``), the algorithm menu the learner's
registries check themselves against (``pieces``: the names and parameters of every piece; ``presets``),
and the root (``root``: YAML plus dotted overrides in, a frozen ``Config`` out).

May import: ``asyncrl.errors`` and ``asyncrl.net`` only (part of the core: no wing, no torch at import).
"""

from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.base import Section
from asyncrl.config.buffer import BufferConfig, MemoryBufferConfig, RedisBufferConfig
from asyncrl.config.data import DataConfig
from asyncrl.config.episode import (
    AgentCommandEpisodeConfig,
    AgentEpisodeConfig,
    AgentServiceEpisodeConfig,
    CompletionEpisodeConfig,
    EpisodeConfig,
    FunctionEpisodeConfig,
    RemoteEnvEpisodeConfig,
)
from asyncrl.config.generator import GeneratorConfig, HfEngineConfig, VllmEngineConfig
from asyncrl.config.learner import LearnerConfig
from asyncrl.config.model import RECIPE_PATHS, LoraConfig, ModelConfig
from asyncrl.config.pieces import (
    AdvantageName,
    AggregationName,
    CorrectionName,
    KlEstimatorName,
    PolicyLossName,
    PresetName,
)
from asyncrl.config.root import MOVED, Config, dump_config, load_config, parse_override, set_dotted
from asyncrl.config.run import RunConfig
from asyncrl.config.weights import (
    MemoryWeightsConfig,
    NcclWeightsConfig,
    ShmWeightsConfig,
    WeightsConfig,
    ZmqWeightsConfig,
)

__all__ = [
    "AdvantageName",
    "AggregationName",
    "CorrectionName",
    "KlEstimatorName",
    "PolicyLossName",
    "PresetName",
    "MOVED",
    "RECIPE_PATHS",
    "AgentCommandEpisodeConfig",
    "AgentServiceEpisodeConfig",
    "AgentEpisodeConfig",
    "AlgorithmConfig",
    "BufferConfig",
    "CompletionEpisodeConfig",
    "Config",
    "DataConfig",
    "EpisodeConfig",
    "FunctionEpisodeConfig",
    "GeneratorConfig",
    "HfEngineConfig",
    "LearnerConfig",
    "LoraConfig",
    "MemoryBufferConfig",
    "MemoryWeightsConfig",
    "ModelConfig",
    "NcclWeightsConfig",
    "RedisBufferConfig",
    "RemoteEnvEpisodeConfig",
    "RunConfig",
    "Section",
    "ShmWeightsConfig",
    "VllmEngineConfig",
    "WeightsConfig",
    "ZmqWeightsConfig",
    "dump_config",
    "load_config",
    "parse_override",
    "set_dotted",
]

"""Pydantic schemas for every config, validated once at the boundary (CLI, YAML, HTTP), one
module per domain. Inner code receives the slice it uses (`SamplingConfig`, one member of
`DrafterConfig`), never the whole tree, and no module below the edge reads environment
variables. `StoreConfig` belongs to the store (`store/config.py`).
"""

from store.config import StoreConfig
from tts_service.config.base import (
    ExistingFile,
    StrictConfig,
    Text,
    load_yaml,
)
from tts_service.config.decoding import (
    MaxRows,
    ModelConfig,
    SamplingConfig,
    default_max_rows,
)
from tts_service.config.drafters import (
    DRAFTER_CONFIGS,
    TREES_DIR,
    DrafterConfig,
    GooseDrafterConfig,
    GtcpDrafterConfig,
    PlainDrafterConfig,
    PldDrafterConfig,
    PtdDrafterConfig,
    RecyclingDrafterConfig,
    Sizing,
    StandDrafterConfig,
    StandDynDrafterConfig,
    StandSpineDrafterConfig,
    TreeName,
    resolve_tree_path,
)
from tts_service.config.jobs import (
    JobConfig,
    Problem,
    read_problems,
)
from tts_service.config.requests import (
    CalibrateTreeRequest,
    GenerateRequest,
    ReplayRequest,
    SolveRequest,
)
from tts_service.config.serve import (
    ServeConfig,
)

__all__ = [
    "CalibrateTreeRequest",
    "DRAFTER_CONFIGS",
    "DrafterConfig",
    "ExistingFile",
    "GenerateRequest",
    "GooseDrafterConfig",
    "GtcpDrafterConfig",
    "JobConfig",
    "MaxRows",
    "ModelConfig",
    "PlainDrafterConfig",
    "PldDrafterConfig",
    "Problem",
    "PtdDrafterConfig",
    "RecyclingDrafterConfig",
    "ReplayRequest",
    "SamplingConfig",
    "ServeConfig",
    "Sizing",
    "SolveRequest",
    "StandDrafterConfig",
    "StandDynDrafterConfig",
    "StandSpineDrafterConfig",
    "StoreConfig",
    "StrictConfig",
    "TREES_DIR",
    "Text",
    "TreeName",
    "default_max_rows",
    "load_yaml",
    "read_problems",
    "resolve_tree_path",
]

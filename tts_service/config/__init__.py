"""The core configs, validated once at the boundary (CLI, YAML, HTTP), one module per domain:
the model and sampling, and the field types drafter configs share. Inner code receives the
slice it uses (`SamplingConfig`, one drafter config), never the whole tree, and no module below
the edge reads environment variables. Each drafter's config lives in its module, the union of
them in `drafters/registry.py`; the edges' requests in `tts_service/schemas/`. Nothing here
imports a drafter. `StoreConfig` belongs to the store (`store/config.py`).
"""

from store.config import StoreConfig
from tts_service.config.base import (
    ExistingFile,
    StrictConfig,
    Text,
    first_error,
    load_yaml,
)
from tts_service.config.decoding import (
    MaxRows,
    ModelConfig,
    SamplingConfig,
    default_max_rows,
)
from tts_service.config.drafters import (
    TREES_DIR,
    Sizing,
    TreeName,
    resolve_tree_path,
)

__all__ = [
    "ExistingFile",
    "MaxRows",
    "ModelConfig",
    "SamplingConfig",
    "Sizing",
    "StoreConfig",
    "StrictConfig",
    "TREES_DIR",
    "Text",
    "TreeName",
    "default_max_rows",
    "first_error",
    "load_yaml",
    "resolve_tree_path",
]

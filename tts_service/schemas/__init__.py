"""The edges' schemas: what the CLI, the jobs and Serve validate at the boundary, each embedding
a drafter config from the registry (`drafters/registry.py`). The core never imports them; it
receives the slices it uses (`tts_service.config`, one drafter config)."""

from tts_service.schemas.jobs import JobConfig, Problem, read_problems
from tts_service.schemas.requests import (
    CalibrateTreeRequest,
    GenerateRequest,
    ReplayRequest,
    SolveRequest,
)
from tts_service.schemas.serve import ServeConfig

__all__ = [
    "CalibrateTreeRequest",
    "GenerateRequest",
    "JobConfig",
    "Problem",
    "ReplayRequest",
    "ServeConfig",
    "SolveRequest",
    "read_problems",
]

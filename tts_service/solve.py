"""Best-of-N for one problem: N trajectories sharing one logit n-gram store.

Trajectory i samples with seed `seed + i`. Trajectories run one after another here, so the
i-th drafts from everything the earlier ones stored (STAND's setting); the acceptance length
per trajectory index shows the store's growth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from store.base import NgramStore
from tts_service.config import DrafterConfig, SamplingConfig
from tts_service.drafters.registry import NoDrafter
from tts_service.engine.decode import OnCommit
from tts_service.engine.metrics import GenerationStats
from tts_service.generation import GenerationOutput, Generator
from tts_service.replay import LoggedProblem, TrajectoryRecorder


@dataclass(frozen=True)
class Trajectory:
    index: int
    seed: int
    output: GenerationOutput
    top_ids: list[list[int]] | None = None  # per token: the target's top-k (when logging)
    top_probs: list[list[float]] | None = None

    def to_dict(self) -> dict:
        return {"index": self.index, "seed": self.seed, **self.output.to_dict()}


@dataclass
class SolveResult:
    trajectories: list[Trajectory] = field(default_factory=list)
    store_stats: dict = field(default_factory=dict)

    def totals(self) -> GenerationStats:
        total = GenerationStats()
        for t in self.trajectories:
            total.merge(t.output.stats)
        return total

    def logged(self, prompt_id: str, prompt_ids: list[int]) -> LoggedProblem:
        """This problem as one line of a trajectory log (see `tts_service.replay`)."""
        recorded = all(t.top_ids is not None for t in self.trajectories)
        return LoggedProblem(
            prompt_id,
            list(prompt_ids),
            [list(t.output.token_ids) for t in self.trajectories],
            [t.top_ids for t in self.trajectories] if recorded else None,
            [t.top_probs for t in self.trajectories] if recorded else None,
        )

    def to_dict(self) -> dict:
        return {
            "trajectories": [t.to_dict() for t in self.trajectories],
            "stats": {
                "num_trajectories": len(self.trajectories),
                "total": self.totals().to_dict(),
                "acceptance_length_by_index": [
                    round(t.output.stats.acceptance_length, 4) for t in self.trajectories
                ],
                "store": self.store_stats,
            },
        }


def solve(
    generator: Generator,
    prompt_ids: list[int],
    n: int,
    drafter: DrafterConfig,
    sampling: SamplingConfig,
    store: NgramStore,
    on_trajectory: Callable[[Trajectory], None] | None = None,
    record: bool = False,
    batch: int = 1,
    token_budget: int = 64,
    on_commit: OnCommit | None = None,
) -> SolveResult:
    """Run `n` trajectories; `on_trajectory` sees each one as it finishes.

    `batch` = 1 runs them one after another; larger runs waves of `batch` rows decoded together
    (`token_budget` tokens per forward, shared out over the rows), later waves drafting from
    what earlier ones stored. With `record`, every trajectory keeps the target's top-k at each
    of its tokens (for the trajectory log); plain decoding then runs through the speculative
    engine with no drafts.
    """
    if n < 1 or batch < 1:
        raise ValueError("n and batch must be >= 1")
    plain = drafter.kind == "plain"
    result = SolveResult()
    for first in range(0, n, batch):
        seeds = list(range(sampling.seed + first, sampling.seed + min(first + batch, n)))
        drafters = [
            NoDrafter() if plain else generator.row_drafter(drafter, store, s) for s in seeds
        ]
        recorders = [TrajectoryRecorder(d) for d in drafters] if record else []
        cfgs = [sampling.model_copy(update={"seed": s}) for s in seeds]
        if len(seeds) == 1:  # alone: plain decoding is the reference loop itself
            single = None if plain and not record else (recorders or drafters)[0]
            outs = [generator.run(prompt_ids, single, cfgs[0], on_commit)]
        else:
            outs = generator.run_batch(
                prompt_ids, recorders or drafters, cfgs, token_budget, on_commit
            )
        for j, (seed, out) in enumerate(zip(seeds, outs, strict=True)):
            rows = recorders[j].rows(len(out.token_ids)) if recorders else (None, None)
            traj = Trajectory(first + j, seed, out, *rows)
            result.trajectories.append(traj)
            if on_trajectory is not None:
                on_trajectory(traj)
    result.store_stats = store.stats()
    return result

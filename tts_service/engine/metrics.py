"""Additive per-trajectory counters; rates are derived only at report time.

Acceptance length = committed tokens per target forward, the bonus token included (so plain
decoding has exactly 1.0). Sums over trajectories, actors and jobs stay correct because only
counts and seconds are stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_forwards: int = 0  # verify forwards that committed tokens (prefill excluded)
    tree_nodes: int = 0  # draft nodes sent to the target, root excluded
    accepted_at_depth: list[int] = field(default_factory=list)  # [d-1]: steps accepting >= d
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0

    def record_step(self, num_nodes: int, num_accepted: int, num_committed: int) -> None:
        self.target_forwards += 1
        self.tree_nodes += num_nodes
        self.new_tokens += num_committed
        if len(self.accepted_at_depth) < num_accepted:
            self.accepted_at_depth.extend([0] * (num_accepted - len(self.accepted_at_depth)))
        for d in range(num_accepted):
            self.accepted_at_depth[d] += 1

    def merge(self, other: GenerationStats) -> None:
        """Add another trajectory's counters into this one."""
        self.new_tokens += other.new_tokens
        self.target_forwards += other.target_forwards
        self.tree_nodes += other.tree_nodes
        for d, c in enumerate(other.accepted_at_depth):
            if d < len(self.accepted_at_depth):
                self.accepted_at_depth[d] += c
            else:
                self.accepted_at_depth.append(c)
        self.draft_s += other.draft_s
        self.verify_s += other.verify_s
        self.wall_s += other.wall_s

    @property
    def acceptance_length(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "acceptance_length": round(self.acceptance_length, 4),
            "tree_nodes": self.tree_nodes,
            "accepted_at_depth": list(self.accepted_at_depth),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "wall_s": round(self.wall_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
        }

"""A tensor-parallel replica on Ray: G rank actors in one STRICT_PACK placement group (a bundle
per rank, so all ranks share a node), joined in a `torch.distributed` group (NCCL on GPUs,
gloo on CPU). Rank 0 decodes (`engine.tp.leader_decoder`); the others run `engine.tp.follow`
until the replica closes. One generation at a time; no restart when a rank dies (yet).
"""

from __future__ import annotations

import socket
from typing import Any

from actors.placement import PlacementError
from tts_service.config import DrafterConfig, ModelConfig, SamplingConfig


class TensorParallelRank:
    """One rank of a replica (a plain class: `TensorParallelReplica` wraps it with Ray)."""

    def __init__(self, cfg: ModelConfig, rank: int, world: int) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world

    def address(self) -> str:
        """host:port for the group's rendezvous, on this rank's node (rank 0's)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def setup(self, address: str) -> None:
        """Join the group and load this rank's shard (every rank at once: both are collective)."""
        import torch.distributed as dist

        from tts_service.models import load_model_shard, resolve_device

        backend = "nccl" if resolve_device(self.cfg.device).type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://{address}", rank=self.rank, world_size=self.world
        )
        self.loaded = load_model_shard(self.cfg)
        if self.rank == 0:
            from tts_service.engine.tp import leader_decoder
            from tts_service.generation import Generator

            self.generator = gen = Generator(self.loaded, max_model_len=self.cfg.max_model_len)
            self.decoder = leader_decoder(self.loaded.model, self.loaded.eos_token_ids, gen.decode)

    def follow(self) -> None:
        """A follower's whole life: mirror rank 0 until it closes the replica."""
        from tts_service.engine.tp import follow

        follow(self.loaded.model)

    def generate(
        self, prompt: str, drafter: DrafterConfig, sampling: SamplingConfig, chat: bool
    ) -> dict:
        """Rank 0: one generation (`tts generate`'s JSON)."""
        gen = self.generator
        ids = gen.encode(prompt, chat)
        gen.check_fits(ids, sampling)
        row = self.decoder.new_row(ids, gen.row_drafter(drafter, gen.store, 0), sampling)
        return gen.output(self.decoder.run([row])[0]).to_dict()

    def close(self) -> None:
        """Rank 0: end the followers' loops."""
        from tts_service.engine.tp import stop

        stop(self.decoder)


class TensorParallelReplica:
    """G rank actors in one STRICT_PACK placement group; `generate` runs on rank 0."""

    def __init__(
        self, cfg: ModelConfig, ranks: int, cpus_per_rank: float = 1.0, timeout_s: float = 60
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from tts_service.models import resolve_device

        gpus = 1 if resolve_device(cfg.device).type == "cuda" else 0
        bundle = {"CPU": cpus_per_rank, **({"GPU": gpus} if gpus else {})}
        self.group = placement_group([dict(bundle)] * ranks, strategy="STRICT_PACK")
        if not self.group.wait(timeout_s):
            remove_placement_group(self.group)
            raise PlacementError(
                f"{ranks} ranks of {bundle} on one node (STRICT_PACK) were not placed within "
                f"{timeout_s:g}s; the cluster has {ray.cluster_resources()}"
            )
        remote = ray.remote(TensorParallelRank)
        self.ranks = [
            remote.options(
                num_cpus=cpus_per_rank,
                num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.group, placement_group_bundle_index=r
                ),
            ).remote(cfg, r, ranks)
            for r in range(ranks)
        ]
        address = ray.get(self.ranks[0].address.remote())
        ray.get([a.setup.remote(address) for a in self.ranks])
        self.following = [a.follow.remote() for a in self.ranks[1:]]

    def generate(self, prompt: str, drafter: Any, sampling: Any, chat: bool = False) -> dict:
        import ray

        return ray.get(self.ranks[0].generate.remote(prompt, drafter, sampling, chat))

    def close(self) -> None:
        """Stop the followers, then the actors and the group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        ray.get(self.ranks[0].close.remote())
        ray.get(self.following)
        for actor in self.ranks:
            ray.kill(actor)
        remove_placement_group(self.group)

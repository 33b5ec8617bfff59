"""Which runs make up a benchmark, and the order they run in.

[Note: alternating runs]
Step times on a shared 2-core machine drift by 10-20% over minutes. Every configuration is run in ``rounds`` rounds,
and each round visits the approaches in a different order (forward, then reversed, then rotated), with the
configurations themselves interleaved round by round. A slow minute therefore lands on different approaches in
different rounds, and a figure pools the timed steps of all rounds of an approach (median, min, max over them).

The goal figures of issue 13 are ratios at M-2 between a few approaches (``GOALS``), and rounds there differ by
10-30% from one another (BENCHMARKS.md findings). So the main configuration runs ``goal_rounds`` more rounds of those
approaches only, after its full rounds: their figures pool twice as many rounds for a few minutes more.
"""

from __future__ import annotations

from dataclasses import dataclass

from zbench.model import SIZES, ModelSize, long_sequence

CORE = ["ddp", "lit_ddp", "torch_zero1", "fsdp2", "lit_fsdp2", "ds_z1", "ds_z2", "ds_z3", "lz_zero1", "lz_zero2",
        "lz_zero3"]
ALL = ["ddp", "lit_ddp", "torch_zero1", "fsdp2_noreshard", "fsdp2", "lit_fsdp2", "ds_z1", "ds_z2", "ds_z3",
       "ds_z1_off", "ds_z2_off", "ds_z3_off", "lz_zero1", "lz_zero2", "lz_zero1_packed", "lz_zero2_packed", "lz_zero3",
       "lz_zero3_noreshard", "lz_zero1_lean", "lz_zero2_lean", "lz_zero3_lean"]
#: The approaches the goal figures at M-2 compare (issue 13): run ``Config.goal_rounds`` more rounds.
GOALS = ["ddp", "lit_ddp", "fsdp2", "lit_fsdp2", "ds_z3", "lz_zero1", "lz_zero2", "lz_zero3"]
WORLD1 = ["single", "lit_single", "ddp", "lit_ddp", "torch_zero1", "fsdp2", "ds_z1", "ds_z2", "ds_z3",
          "lz_zero1", "lz_zero2", "lz_zero3"]


@dataclass(frozen=True)
class Config:
    name: str
    purpose: str  # main | size | ranks | long-seq
    size: ModelSize
    world: int
    batch: int  # sequences per rank
    approaches: tuple[str, ...]
    rounds: int
    warmup: int
    steps: int  # timed steps per round
    goal_rounds: int = 0  # more rounds, after ``rounds``, of the approaches in GOALS only

    def rounds_of(self, approach: str) -> int:
        return self.rounds + (self.goal_rounds if approach in GOALS else 0)


def full_plan(rounds: int = 2, warmup: int = 2, steps: int = 4, goal_rounds: int | None = None) -> list[Config]:
    """``rounds`` of each scaling configuration, one more of the main one, and ``goal_rounds`` (by default as many
    as the main configuration's) more of its GOALS approaches."""
    m = SIZES["M"]
    goal_rounds = rounds + 1 if goal_rounds is None else goal_rounds
    return [
        Config("M-2", "main", m, 2, 2, tuple(ALL), rounds + 1, warmup, steps, goal_rounds=goal_rounds),
        Config("S-2", "size", SIZES["S"], 2, 2, tuple(CORE), rounds, warmup, steps),
        Config("L-2", "size", SIZES["L"], 2, 2, tuple(CORE), rounds, warmup, steps),
        Config("M-1", "ranks", m, 1, 2, tuple(WORLD1), rounds, warmup, steps),
        Config("M-4", "ranks", m, 4, 2, tuple(CORE), rounds, warmup, steps),
        Config("M-seq1024-2", "long-seq", long_sequence(m, 1024), 2, 1, tuple(CORE), rounds, warmup, steps),
    ]


def quick_plan() -> list[Config]:
    tiny = SIZES["tiny"]
    two = ("ddp", "lit_ddp", "torch_zero1", "fsdp2", "lit_fsdp2", "ds_z1", "ds_z2", "ds_z3", "lz_zero1", "lz_zero2",
           "lz_zero3")
    return [
        Config("tiny-2", "main", tiny, 2, 2, two, 1, 2, 3),
        Config("tiny-1", "ranks", tiny, 1, 2, ("single", "lz_zero3"), 1, 2, 3),
    ]


def schedule(configs: list[Config]) -> list[tuple[Config, str, int]]:
    """(config, approach, round) in run order (see [Note: alternating runs])."""
    order = []
    for r in range(max(c.rounds + c.goal_rounds for c in configs)):
        for c in configs:
            names = [n for n in c.approaches if r < c.rounds_of(n)]
            if not names:
                continue
            if r % 2 == 1:
                names.reverse()
            shift = (r // 2) * (len(names) // 3 + 1)
            names = names[shift % len(names):] + names[: shift % len(names)]
            order += [(c, n, r) for n in names]
    return order

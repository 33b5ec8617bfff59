"""Side-by-side benchmark of lightning_zero against DDP, torch's ZeroRedundancyOptimizer, FSDP2 and DeepSpeed.

Entry point: ``benchmarks/compare.py`` (see its docstring and BENCHMARKS.md). Modules:

- ``model``: the GPT model, the synthetic data and the model sizes (identical for every approach)
- ``measure``: communication counting (wrapping ``torch.distributed``), held-tensor bytes, RSS
- ``approaches``: how each approach builds its training step (raw loops and Lightning ``Trainer`` runs)
- ``worker``: one rank of one run (a fresh process), writes a JSON record
- ``plan``: which runs make up a full or ``--quick`` benchmark, and in which (alternating) order
- ``report``: tables (BENCHMARKS.md) and the plot
"""

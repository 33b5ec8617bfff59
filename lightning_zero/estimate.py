"""The memory model: model-state bytes per rank for DDP, ZeRO stages 1-3 and their offload options, by placement
(device, host memory, disk), and the least complex option that fits; and the communication model beside it.

The models live in five modules, all re-exported here, where users import them from: estimate_options.py (the
options ``LAYOUTS``, the precisions, the inputs' checks), memory_model.py (the model states by placement,
``estimate``: [Note: what the memory model counts], [Note: offload in the memory model]), peak_model.py (the peak of
each phase of a run: [Note: the peak of a run], [Note: where stage 3's step peaks]), recommend.py (the least complex
option that fits) and comm_model.py (the bytes one rank moves per step).
"""

from lightning_zero.comm_model import communication_bytes, hybrid_communication_bytes, quantized_reduce_bytes
from lightning_zero.estimate_options import (
    IN_DEVICE_OPTIONS,
    LAYOUTS,
    OPTIONS,
    PRECISIONS,
    EstimateError,
    Layout,
    format_bytes,
    how_to_select,
    option_name,
    parse_count,
    working_bytes,
)
from lightning_zero.memory_model import Budget, MemoryEstimate, estimate, estimate_all, hpz_bytes
from lightning_zero.peak_model import PHASES, PeakEstimate, PeakInputs, peak_estimate, with_peak
from lightning_zero.recommend import Recommendation, recommend

__all__ = [
    "IN_DEVICE_OPTIONS",
    "LAYOUTS",
    "OPTIONS",
    "PHASES",
    "PRECISIONS",
    "Budget",
    "EstimateError",
    "Layout",
    "MemoryEstimate",
    "PeakEstimate",
    "PeakInputs",
    "Recommendation",
    "communication_bytes",
    "estimate",
    "estimate_all",
    "format_bytes",
    "how_to_select",
    "hpz_bytes",
    "hybrid_communication_bytes",
    "option_name",
    "parse_count",
    "peak_estimate",
    "quantized_reduce_bytes",
    "recommend",
    "with_peak",
    "working_bytes",
]

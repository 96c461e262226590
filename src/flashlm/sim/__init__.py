"""flashlm.sim: offline studies on recorded traces (cache-policy replay, Belady's oracle) and the
hardware simulator (latency per token on a device profile, DIP appendix A, LLM in a flash §3)."""

from .hardware import PRESETS, HardwareProfile, get_preset, load_profile, save_profile, this_machine
from .replay import REPLAY_POLICIES, ReplayResult, replay
from .simulator import (
    ANALYTIC_POLICIES,
    MODEL_PRESETS,
    TRACE_POLICIES,
    Allocation,
    AnalyticDemand,
    ModelDims,
    SimulationResult,
    Workload,
    allocate,
    simulate,
)

__all__ = [
    "ANALYTIC_POLICIES",
    "MODEL_PRESETS",
    "PRESETS",
    "REPLAY_POLICIES",
    "TRACE_POLICIES",
    "Allocation",
    "AnalyticDemand",
    "HardwareProfile",
    "ModelDims",
    "ReplayResult",
    "SimulationResult",
    "Workload",
    "allocate",
    "get_preset",
    "load_profile",
    "replay",
    "save_profile",
    "simulate",
    "this_machine",
]

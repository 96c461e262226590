"""flashlm.sim: offline studies on recorded traces (cache-policy replay, Belady's oracle)."""

from .replay import REPLAY_POLICIES, ReplayResult, replay

__all__ = ["REPLAY_POLICIES", "ReplayResult", "replay"]

"""flashlm.cache: the budgeted neuron cache (preallocated slots, id->slot map, policies, budget split)."""

from .budget import BudgetPlan, split_budget
from .neuron_cache import NeuronCache, read_ahead_block
from .policies import (
    ATUPolicy,
    BeladyPolicy,
    EvictionPolicy,
    LFUPolicy,
    LRUPolicy,
    WindowPolicy,
    available_policies,
    make_policy,
    policy_state_bytes,
    register_policy,
)

__all__ = [
    "ATUPolicy",
    "BeladyPolicy",
    "BudgetPlan",
    "EvictionPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "NeuronCache",
    "WindowPolicy",
    "available_policies",
    "make_policy",
    "policy_state_bytes",
    "read_ahead_block",
    "register_policy",
    "split_budget",
]

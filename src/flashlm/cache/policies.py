"""Eviction policies of the neuron cache: which units are worth keeping, and which must go.

A policy only ranks units; the cache (`NeuronCache`) does the moving. It sees every unit a decode
step needs (`record`), answers how much each unit is worth keeping (`priority`, comparable
between residents and candidates, so the cache can admit a miss only when it beats a resident),
and may force units out whatever the pressure (`expired`, the sliding window of LLM in a flash
§3.1). New policies join with `@register_policy`.

State is a few int64 vectors of length `num_units`, held as non-persistent buffers: `.to()` moves
them with the model, and `state_dict()` does not carry them (they describe one run, not the model).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError
from ..registry import Registry

STATE_DTYPE = torch.int64
"""Dtype of every policy state vector (steps and counts)."""

POLICIES: Registry = Registry("eviction policies")
"""Every eviction policy, by name (`@register_policy`); `FlashConfig.policy` also takes "none" (no cache)."""
register_policy = POLICIES.register
NO_CACHE = "none"
"""The `FlashConfig.policy` that caches nothing: every unit is read every time it is used."""


def available_policies() -> list[str]:
    """Names `make_policy` accepts, sorted."""
    return list(POLICIES.names())


def make_policy(name: str, num_units: int, **options: object) -> EvictionPolicy:
    """Build the policy registered as `name` for a layer of `num_units` units.

    Raises `ConfigError` for an unknown name or an option the policy does not take.
    """
    cls = POLICIES[name]
    try:
        inspect.signature(cls).bind(num_units, **options)
    except TypeError as exc:
        raise ConfigError(f"Eviction policy {name!r}: {exc}.") from None
    return cls(num_units, **options)


def policy_state_bytes(name: str, num_units: int) -> int:
    """Bytes of state the policy `name` allocates for `num_units` units (what the budget must count)."""
    return POLICIES[name].state_bytes(num_units)


@dataclass(frozen=True)
class PriorityTerms:
    """A policy whose whole behaviour is two state vectors and a window: `record` adds one to `count`
    (None: no count) and sets `last_step`; `priority` is `count * 2**32 + last_step`; a unit last used
    `window` or more steps ago expires (0: none ever does)."""

    count: torch.Tensor | None
    last_step: torch.Tensor
    window: int = 0


class EvictionPolicy(nn.Module):
    """Base of the cache's eviction policies.

    Subclasses declare their per-unit state in `STATE` (buffer name -> initial value); the base
    class allocates it, resets it, and derives `state_bytes` from it, so the budget and the
    allocation cannot disagree.
    """

    name: ClassVar[str]
    STATE: ClassVar[dict[str, int]] = {}
    EXPIRES: ClassVar[bool] = False
    """Whether `expired` can flag anything (the cache skips the check for policies that never do)."""
    OFFLINE: ClassVar[bool] = False
    """Whether the policy needs the future (a trace) and so runs only in the offline replay."""

    def __init__(self, num_units: int) -> None:
        super().__init__()
        if num_units < 0:
            raise ConfigError(f"num_units must be non-negative, got {num_units}.")
        self.num_units = num_units
        for buffer, initial in self.STATE.items():
            self.register_buffer(
                buffer, torch.full((num_units,), initial, dtype=STATE_DTYPE), persistent=False
            )

    @classmethod
    def state_bytes(cls, num_units: int) -> int:
        """Bytes of the state buffers an instance for `num_units` units holds."""
        itemsize = torch.empty((), dtype=STATE_DTYPE).element_size()
        return len(cls.STATE) * num_units * itemsize

    def reset(self) -> None:
        """Forget all history (a new sequence starts)."""
        for buffer, initial in self.STATE.items():
            getattr(self, buffer).fill_(initial)

    def record(self, ids: torch.Tensor, step: int) -> None:
        """Note that the units `ids` (hits and misses alike) were used at decode step `step`."""
        raise NotImplementedError

    def priority(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 worth of keeping each unit: higher stays. Comparable across residents and candidates."""
        raise NotImplementedError

    def priority_terms(self) -> PriorityTerms | None:
        """The policy as `PriorityTerms`, where it is one: the cache's C path then records, expires and
        ranks on them itself (`NeuronCache.update`). None where the policy is otherwise."""
        return None

    def expired(self, ids: torch.Tensor, step: int) -> torch.Tensor:
        """Which of the resident units `ids` must leave at `step` whatever the pressure (none by default)."""
        return torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)

    def extra_repr(self) -> str:
        return f"num_units={self.num_units}"


@register_policy("lru")
class LRUPolicy(EvictionPolicy):
    """Least recently used: priority is the last step a unit was used (-1 if never)."""

    STATE = {"last_step": -1}
    last_step: torch.Tensor

    def record(self, ids: torch.Tensor, step: int) -> None:
        self.last_step[ids] = step

    def priority(self, ids: torch.Tensor) -> torch.Tensor:
        return self.last_step[ids]

    def priority_terms(self) -> PriorityTerms:
        return PriorityTerms(None, self.last_step)


@register_policy("lfu")
class LFUPolicy(EvictionPolicy):
    """Least frequently used; among equally frequent units the least recent leaves first.

    priority = count * 2**32 + last_step, so the count dominates and recency breaks ties (steps
    stay below 2**31 in any realistic run).
    """

    STATE = {"count": 0, "last_step": -1}
    count: torch.Tensor
    last_step: torch.Tensor

    def record(self, ids: torch.Tensor, step: int) -> None:
        # index_add_ rather than `count[ids] += 1`, which would count a repeated id once.
        self.count.index_add_(0, ids, torch.ones_like(ids, dtype=STATE_DTYPE))
        self.last_step[ids] = step

    def priority(self, ids: torch.Tensor) -> torch.Tensor:
        return self.count[ids] * 2**32 + self.last_step[ids]

    def priority_terms(self) -> PriorityTerms:
        return PriorityTerms(self.count, self.last_step)


@register_policy("window")
class WindowPolicy(EvictionPolicy):
    """Sliding window (LLM in a flash §3.1): keep the units used by the last `window` tokens.

    A unit last used at step s expires at step s + window even with free slots, which is what keeps
    the cache at the window's aggregate working set. Under pressure it behaves as LRU.
    """

    STATE = {"last_step": -1}
    EXPIRES = True
    last_step: torch.Tensor

    def __init__(self, num_units: int, window: int = 4) -> None:
        super().__init__(num_units)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(f"The sliding window must be a positive number of tokens, got {window!r}.")
        self.window = window

    def record(self, ids: torch.Tensor, step: int) -> None:
        self.last_step[ids] = step

    def priority(self, ids: torch.Tensor) -> torch.Tensor:
        return self.last_step[ids]

    def priority_terms(self) -> PriorityTerms:
        return PriorityTerms(None, self.last_step, self.window)

    def expired(self, ids: torch.Tensor, step: int) -> torch.Tensor:
        return self.last_step[ids] <= step - self.window

    def extra_repr(self) -> str:
        return f"num_units={self.num_units}, window={self.window}"


@register_policy("atu")
class ATUPolicy(WindowPolicy):
    """Adjacent Token Update (M2Cache §5.3): keep exactly the units the previous token used.

    M2Cache's HBM cache "only updates the neurons that differ between tokens" and, unlike LRU or a
    sliding window, does not retain hot units. Here that is a sliding window of one token: every
    resident the current step did not use expires at that step, even with free slots, and the
    step's misses are admitted, so after a step the cache holds the units it used (all of them
    when they fit). Priority is recency, as in LRU; under pressure (more units than slots) every
    unit left is the step's own, equally recent, so the admission rule's no-churn tie keeps the
    hits and fills the free slots with misses (lowest ids first).
    """

    def __init__(self, num_units: int) -> None:
        super().__init__(num_units, window=1)

    def extra_repr(self) -> str:
        return f"num_units={self.num_units}"


@register_policy("belady")
class BeladyPolicy(EvictionPolicy):
    """Belady's MIN (1966), the offline oracle: keep the units needed soonest (DIP §5.1, §6.4).

    It is given the future: `requests[s]` are the unit ids step `s` needs (a trace's
    `requests(layer, kind)`). A unit's priority is minus the step it is next needed at, so sooner
    is worth more and a unit never needed again (`NEVER`) is worth least. Under `NeuronCache`'s
    admission rule (a miss enters only if strictly better than the weakest resident) this is MIN
    with bypass: after each step the cache holds the `capacity` units, among its residents and the
    units just read, that are needed soonest; that is optimal in misses, one unit or many per step.

    Steps passed to `record` must be the indices into `requests`. For offline replay only
    (`flashlm.sim.replay`): `FlashConfig` does not accept it. Without `requests` it knows no
    future and every unit is worth the same (never needed).

    State: `next_use` (in `STATE`, counted by `state_bytes`). The future itself is input, not
    state, and `state_bytes` does not count it: `use_keys` (a buffer, one int64 per (unit, step)
    use, sorted) answers any `record`, and when `record` gets exactly `requests[step]` (as in a
    replay) a per-step table of precomputed next uses answers it without a search.
    """

    NEVER: ClassVar[int] = 2**62
    """`next_use` of a unit no later step needs."""

    STATE = {"next_use": NEVER}
    OFFLINE = True
    next_use: torch.Tensor
    use_keys: torch.Tensor

    def __init__(self, num_units: int, requests: Sequence[torch.Tensor] | None = None) -> None:
        super().__init__(num_units)
        steps = [
            torch.unique(torch.as_tensor(ids).reshape(-1).to("cpu", STATE_DTYPE)) for ids in requests or ()
        ]
        for step, ids in enumerate(steps):
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_units):
                raise ConfigError(
                    f"Belady: step {step} requests unit ids outside 0..{num_units - 1} "
                    f"(min {int(ids.min())}, max {int(ids.max())})."
                )
        self.num_steps = len(steps)
        # A use of unit u at step s is the key u * (num_steps + 1) + s: sorted keys run by unit,
        # then step, so a key's successor is the same unit's next use if it is the same unit.
        counts = [ids.numel() for ids in steps]
        keys = torch.cat([ids * self._stride + s for s, ids in enumerate(steps)]) if steps else None
        if keys is None or keys.numel() == 0:
            self.register_buffer("use_keys", torch.empty(0, dtype=STATE_DTYPE), persistent=False)
            self._steps: list[torch.Tensor] = steps
            self._next_after: list[torch.Tensor] = [torch.full_like(ids, self.NEVER) for ids in steps]
        else:
            # numpy's sort is an order of magnitude faster than torch's on CPU here; keys are unique.
            order = torch.from_numpy(np.argsort(keys.numpy()))
            sorted_keys = keys[order]
            unit, step = sorted_keys // self._stride, sorted_keys % self._stride
            following = torch.full_like(sorted_keys, self.NEVER)
            same = unit[1:] == unit[:-1]
            following[:-1] = torch.where(same, step[1:], following[:-1])
            next_after = torch.empty_like(following)
            next_after[order] = following
            self.register_buffer("use_keys", sorted_keys, persistent=False)
            self._steps = steps
            self._next_after = list(torch.split(next_after, counts))
        self.reset()

    @property
    def _stride(self) -> int:
        return self.num_steps + 1

    def _next_use_after(self, ids: torch.Tensor, step: int) -> torch.Tensor:
        """The first step after `step` that needs each unit of `ids`, `NEVER` if none (a search)."""
        ids = ids.to(device=self.use_keys.device, dtype=STATE_DTYPE)
        if self.use_keys.numel() == 0:
            return torch.full_like(ids, self.NEVER)
        base = ids * self._stride
        at = torch.searchsorted(self.use_keys, base + step, right=True)
        found = self.use_keys[at.clamp(max=self.use_keys.numel() - 1)]
        # The key found belongs to the same unit only if it is below the next unit's first key.
        ahead = (at < self.use_keys.numel()) & (found < base + self._stride)
        return torch.where(ahead, found - base, torch.full_like(ids, self.NEVER))

    def reset(self) -> None:
        """Back to the start of the future: every unit's next use is its first."""
        super().reset()
        if hasattr(self, "use_keys"):
            all_ids = torch.arange(self.num_units, device=self.next_use.device)
            self.next_use.copy_(self._next_use_after(all_ids, -1))

    def record(self, ids: torch.Tensor, step: int) -> None:
        if 0 <= step < self.num_steps:
            planned = self._steps[step]
            if ids.device == planned.device and ids.shape == planned.shape and torch.equal(ids, planned):
                self.next_use[ids] = self._next_after[step].to(self.next_use.device)
                return
        self.next_use[ids] = self._next_use_after(ids, step).to(self.next_use.device)

    def priority(self, ids: torch.Tensor) -> torch.Tensor:
        return -self.next_use[ids]

    def extra_repr(self) -> str:
        return f"num_units={self.num_units}, num_steps={self.num_steps}"

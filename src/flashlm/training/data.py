"""Training text: corpus token streams packed into fixed-length sequences.

Relufication (and the LoRA recovery that reuses the trainer) trains on the `"calibration"` split of
flashlm's offline corpora (`flashlm.data.corpora`), never on the `"test"` split that the perplexity
harness and the sparsity measurement read. Each corpus's stream is cut into back-to-back windows of
`seq_len` tokens (the last partial window is dropped) so a sequence never spans two corpora and no
token is padding: every position of every row is a real next-token prediction.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ConfigError


def pack(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """`[n, seq_len]` int64 rows of the 1-D stream `ids`, back to back; a partial last row is dropped."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ConfigError(f"seq_len must be an int >= 2 (a token and the one it predicts), got {seq_len!r}.")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
        raise ConfigError("pack() needs a 1-D tensor of token ids (a corpus split from corpus_tokens).")
    rows = ids.numel() // seq_len
    return ids[: rows * seq_len].long().reshape(rows, seq_len)


def corpus_sequences(
    corpora: Sequence[str], tokenizer: Any, seq_len: int, *, split: str = "calibration"
) -> torch.Tensor:
    """The `split` of every corpus in `corpora`, each packed into `seq_len`-token rows, concatenated.

    Raises `CorpusNotFoundError` (saying what to install) for a missing corpus, and `ConfigError` when
    the corpora hold no complete row.
    """
    from ..data.corpora import corpus_tokens, require

    if not corpora:
        raise ConfigError("Name at least one corpus to train on (flashlm.data.corpora.CORPORA).")
    for name in corpora:
        require(name)  # fail on a missing corpus before tokenizing the others
    parts = [pack(corpus_tokens(name, tokenizer, split=split), seq_len) for name in corpora]
    sequences = torch.cat(parts)
    if sequences.shape[0] == 0:
        raise ConfigError(
            f"The {split} split of {', '.join(corpora)} holds fewer than seq_len={seq_len} tokens: "
            "use a shorter sequence length or more corpora."
        )
    return sequences


def fingerprint(sequences: torch.Tensor) -> str:
    """sha256 of a sequence table's shape and ids: a resumed run must train on exactly the same rows."""
    digest = hashlib.sha256(repr(tuple(sequences.shape)).encode())
    digest.update(sequences.contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


class SequenceSampler:
    """Which rows each process trains on at each step: a pure function of the step, not a loader's state.

    The global batch of step `s` (0-based) is `world * accumulation * batch_size` rows; row `g` of the
    whole run (counting micro-batches, then processes, then rows) is row `g % n` of epoch `g // n`'s
    permutation, drawn from a generator seeded with `(seed, epoch)`. Because nothing but the step
    decides the rows, a run resumed from a checkpoint sees exactly the rows an uninterrupted run
    would, without saving a data loader's position; each process takes a disjoint slice of the
    global batch, as a distributed sampler would.
    """

    def __init__(self, num_rows: int, *, batch_size: int, accumulation: int, world: int, seed: int) -> None:
        if num_rows < 1:
            raise ConfigError("The training set is empty: give more text or a shorter sequence length.")
        self.num_rows = num_rows
        self.batch_size = batch_size
        self.accumulation = accumulation
        self.world = world
        self.seed = seed
        self._permutations: dict[int, torch.Tensor] = {}

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:  # a micro-batch spans at most two epochs
                self._permutations.pop(min(self._permutations))
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._permutations[epoch] = torch.randperm(self.num_rows, generator=generator)
        return self._permutations[epoch]

    def rows(self, step: int, micro: int, rank: int) -> list[int]:
        """Row indices of process `rank`'s micro-batch `micro` of step `step` (all 0-based)."""
        first = ((step * self.accumulation + micro) * self.world + rank) * self.batch_size
        rows = []
        for g in range(first, first + self.batch_size):
            epoch, offset = divmod(g, self.num_rows)
            rows.append(int(self._permutation(epoch)[offset]))
        return rows

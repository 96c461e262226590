"""Training text: corpus token streams packed into fixed-length sequences.

Relufication (and the LoRA recovery that reuses the trainer) trains on the `"calibration"` split of
flashlm's offline corpora (`flashlm.data.corpora`), never on the `"test"` split that the perplexity
harness and the sparsity measurement read, and on any text files the user names. Each stream (a
corpus's split, a file) is cut into back-to-back windows of `seq_len` tokens (the last partial window
is dropped) so a sequence never spans two streams and no token is padding: every position of every
row is a real next-token prediction.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
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


def evenly_spaced_rows(rows: torch.Tensor, count: int) -> torch.Tensor:
    """`count` of `rows` (all of them if there are no more), evenly spaced from the first to the last.
    Rows packed from several streams (`corpus_sequences`) keep their streams' order, so their first
    rows are all the first stream's: a spaced sample covers every stream in proportion to its size."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"count must be an int >= 1, got {count!r}.")
    if count >= rows.shape[0]:
        return rows
    return rows[torch.linspace(0, rows.shape[0] - 1, count).round().long()]


def corpus_sequences(
    corpora: Sequence[str],
    tokenizer: Any,
    seq_len: int,
    *,
    split: str = "calibration",
    texts: Sequence[str | os.PathLike] = (),
) -> torch.Tensor:
    """The `split` of every corpus in `corpora`, then every UTF-8 text file in `texts` whole (the user's
    own text, from the domain the model will run on), each packed into `seq_len`-token rows, concatenated.

    Raises `CorpusNotFoundError` (saying what to install) for a missing corpus, and `ConfigError` for a
    text file that cannot be read as UTF-8 or when the corpora and texts hold no complete row.
    """
    from ..data.corpora import corpus_tokens, encode_text, read_text_file, require

    if not corpora and not texts:
        raise ConfigError("Name at least one corpus (flashlm.data.corpora.CORPORA) or text file to train on.")
    for name in corpora:
        require(name)  # fail on a missing corpus or file before tokenizing the others
    streams = [read_text_file(path, role="Training text") for path in texts]
    parts = [pack(corpus_tokens(name, tokenizer, split=split), seq_len) for name in corpora]
    parts += [pack(encode_text(tokenizer, text), seq_len) for text in streams]
    sequences = torch.cat(parts)
    if sequences.shape[0] == 0:
        sources = [f"the {split} split of {name}" for name in corpora] + [str(path) for path in texts]
        raise ConfigError(
            f"{', '.join(sources)} hold fewer than seq_len={seq_len} tokens each: use a shorter sequence "
            "length or more text."
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


SAMPLE_PROMPT_TOKENS = 16
"""Each teacher sample continues the first tokens of a real training row, so it starts in the text's
domain; 16 tokens is enough for a 135M model to pick the register (verse, prose, documentation)."""
TEACHER_PROMPTS = ("rows", "start")
"""Where teacher samples start: `rows` continue a training row's first `SAMPLE_PROMPT_TOKENS` tokens
(the training corpora's domains); `start` is sampled from the teacher's start-of-text token alone
(its whole distribution: code, math, prose; LLM-QAT's data-free generation)."""
SAMPLES_NAME = "teacher_samples.pt"
_SAMPLE_BATCH = 64


@torch.no_grad()
def teacher_samples(
    teacher: Any,
    sequences: torch.Tensor,
    count: int,
    *,
    seed: int,
    source: str,
    cache: str | os.PathLike,
    device: torch.device | str | None = None,
    progress: bool = False,
    prompts: str = "rows",
) -> torch.Tensor:
    """`[count, L]` rows sampled from the dense `teacher` (temperature 1): more text to distil on.

    The calibration splits hold few tokens (SmolLM2's three corpora: 1706 rows of 128), and a student
    distilled on them for several epochs matches the teacher twice as closely on them as on held-out
    text. The teacher's own samples cost no data (LLM-QAT's data-free distillation). With `prompts=
    "rows"` each row continues the first `SAMPLE_PROMPT_TOKENS` tokens of a row of `sequences`, drawn
    with `seed`; with `"start"` it starts from the teacher's start-of-text token (its `bos_token_id`,
    else its `eos_token_id`, the separator of packed documents), so the rows cover the teacher's
    whole distribution rather than the training domains. Rows run to `L = sequences.shape[1]` tokens
    (end-of-sequence suppressed, so no row is padded).

    The teacher samples on `device` (None: where it is) and is moved back afterwards: a recipe loads
    it on the CPU, and sampling a large model there would take hours where an accelerator has one.

    The rows are kept in `cache`, keyed by `source` (the teacher's checkpoint), the seed and the
    prompts, and written to a temporary name and renamed: a resumed run, or another process of the
    same run, trains on exactly the same rows without sampling them again.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ConfigError(f"teacher_samples must be an int >= 0 (rows to sample), got {count!r}.")
    check_teacher_prompts(prompts)
    seq_len = sequences.shape[1]
    if count and prompts == "rows" and seq_len <= SAMPLE_PROMPT_TOKENS:
        raise ConfigError(
            f"Teacher samples continue a {SAMPLE_PROMPT_TOKENS}-token prompt: use seq_len > "
            f"{SAMPLE_PROMPT_TOKENS} (got {seq_len}), prompts='start', or no teacher samples."
        )
    if count == 0:
        return sequences.new_empty((0, seq_len))
    if prompts == "rows":
        generator = torch.Generator().manual_seed(seed)
        order = torch.cat(
            [torch.randperm(len(sequences), generator=generator) for _ in range(-(-count // len(sequences)))]
        )
        prompt_ids = sequences[order[:count], :SAMPLE_PROMPT_TOKENS]
    else:
        prompt_ids = torch.full((count, 1), start_token(teacher), dtype=torch.long)
    key = {
        "source": source,
        "seed": seed,
        "count": count,
        "seq_len": seq_len,
        "prompts": fingerprint(prompt_ids),
    }
    cache = Path(cache)
    if cache.is_file():
        saved = torch.load(cache, weights_only=True)
        if saved.get("key") == key:
            return saved["rows"]

    from tqdm.auto import tqdm
    from transformers import GenerationConfig

    # a fresh config: plain sampling whatever the checkpoint's defaults (repetition penalty, top-p, ...)
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=seq_len - prompt_ids.shape[1],
        min_new_tokens=seq_len - prompt_ids.shape[1],  # suppresses the end of sequence: no padding
        eos_token_id=teacher.generation_config.eos_token_id,
        pad_token_id=teacher.generation_config.eos_token_id,
    )

    home = next(teacher.parameters()).device
    device = torch.device(device) if device is not None else home
    rows = []
    teacher.to(device)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            for start in tqdm(
                range(0, count, _SAMPLE_BATCH), desc="Sampling from the teacher", disable=not progress
            ):
                batch = prompt_ids[start : start + _SAMPLE_BATCH].to(device)
                mask = torch.ones_like(batch)
                rows.append(teacher.generate(batch, attention_mask=mask, generation_config=config).cpu())
    finally:
        teacher.to(home)
    samples = torch.cat(rows).long()
    if samples.shape != (count, seq_len):
        raise ConfigError(
            f"The teacher's generate() returned rows of shape {tuple(samples.shape)}, not "
            f"({count}, {seq_len}): it must return the prompt and seq_len - {prompt_ids.shape[1]} tokens."
        )
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f".{cache.name}.tmp")
    torch.save({"key": key, "rows": samples}, tmp)
    os.replace(tmp, cache)
    return samples


def check_teacher_prompts(prompts: str) -> None:
    if prompts not in TEACHER_PROMPTS:
        raise ConfigError(f"teacher_prompts must be one of {TEACHER_PROMPTS}, got {prompts!r}.")


def start_token(model: Any) -> int:
    """The token a document starts after in `model`'s training text: its BOS, else its EOS (packed
    pretraining text separates documents by it)."""
    config = model.generation_config
    for token in (config.bos_token_id, config.eos_token_id):
        if isinstance(token, (list, tuple)):
            token = token[0] if token else None
        if token is not None:
            return int(token)
    raise ConfigError(
        "Teacher samples from the start need the model's bos_token_id or eos_token_id, and its "
        "generation_config has neither: set one, or use prompts='rows'."
    )

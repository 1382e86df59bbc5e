"""Training data: synthetic token streams (tests, demos, benchmarks) and flat binary token files.

Both give ``batch(step, global_batch) -> LongTensor [global_batch, seq_length + 1]``: the whole
global batch of a step, deterministic in (seed, step) and independent of how the ranks split it.
Ranks take their rows (:func:`split_batch`) and, under context parallelism, their positions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from planner.errors import AutoparError


class SyntheticTokens:
    """Sequences from a fixed random first-order Markov chain over the vocabulary.

    Each token has ``branching`` likely successors, so the next-token loss can fall from ln(V) to
    about ln(branching) — a run that learns shows it within a few dozen steps."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int = 0, branching: int = 4) -> None:
        if vocab_size < 2:
            raise AutoparError("vocab_size", vocab_size, "use at least 2", problem="is too small")
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)

    def batch(self, step: int, global_batch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 7919 + step + 1)
        out = torch.empty(global_batch, self.seq_length + 1, dtype=torch.long)
        out[:, 0] = torch.randint(0, self.vocab_size, (global_batch,), generator=g)
        choice = torch.randint(0, self.successors.shape[1], (global_batch, self.seq_length), generator=g)
        # the chain walks one position at a time: in NumPy on views of the same memory (a torch
        # indexing op per position took 21.6 ms for 8 x 2048 tokens on an AVX2 VM, NumPy 3.4 ms; same tokens)
        tokens, picks, successors = out.numpy(), choice.numpy(), self.successors.numpy()
        for t in range(self.seq_length):
            tokens[:, t + 1] = successors[tokens[:, t], picks[:, t]]
        return out


def token_dtype(vocab_size: int) -> str:
    """The dtype of a flat token file for a vocabulary: uint16 when its ids fit, else uint32."""
    return "uint16" if vocab_size <= 65_536 else "uint32"


def check_token_file(path: str | Path, seq_length: int, vocab_size: int, dtype: str | None = None) -> np.memmap:
    """The tokens of a flat token file, read by memmap, after the checks a run needs: a readable file
    (not a folder), a whole number of ``dtype`` ids, at least one sequence of ``seq_length + 1`` tokens,
    every id below ``vocab_size`` (a scan of the whole file). Raises AutoparError naming ``--data``.

    ``autopar run`` calls this before any worker starts, and each worker again through
    :class:`TokenFile`: a bad file is refused with the fix, not found by torchrun's workers."""
    path = Path(path)
    if path.is_dir():
        raise AutoparError("--data", str(path), "give a flat token file (uint16/uint32 ids), not a folder",
                           problem="is a folder")
    if not path.is_file():
        raise AutoparError("--data", str(path), "give an existing flat token file (uint16/uint32 ids)",
                           problem="is not a regular file" if path.exists() else "does not exist")
    dtype = dtype or token_dtype(vocab_size)
    if dtype not in ("uint16", "uint32"):
        raise AutoparError("--data-dtype", dtype, "use uint16 or uint32", problem="is not a token dtype")
    size = np.dtype(dtype).itemsize
    nbytes = path.stat().st_size
    if nbytes % size:
        raise AutoparError("--data", str(path), f"write the token ids as a flat {dtype} array (the dtype for "
                           f"vocab_size={vocab_size}: uint16 up to 65,536 ids, else uint32)",
                           problem=f"is not a flat array of {dtype} ({nbytes} bytes is not a multiple of {size})")
    if nbytes // size < seq_length + 1:
        raise AutoparError("--data", str(path), f"give a file of at least {seq_length + 1} {dtype} tokens "
                           f"({(seq_length + 1) * size} bytes)",
                           problem=f"holds {nbytes // size} tokens, fewer than one sequence")
    try:
        tokens = np.memmap(path, dtype=dtype, mode="r")
        top = int(tokens.max())
    except OSError as exc:
        raise AutoparError("--data", str(path), "give a token file this user can read",
                           problem=f"cannot be read ({exc.strerror or exc})") from None
    if top >= vocab_size:
        raise AutoparError("--data", str(path), f"use a model with vocab_size > {top} or the right file (token ids "
                           f"as {dtype}, each below vocab_size)",
                           problem=f"has token id {top} >= vocab_size={vocab_size}")
    return tokens


class TokenFile:
    """A flat binary file of token ids (uint16 when the vocabulary fits, else uint32), read by memmap
    and checked by :func:`check_token_file`.

    Step s reads the global batch's rows from consecutive windows of ``seq_length + 1`` tokens,
    wrapping around at the end of the file."""

    def __init__(self, path: str | Path, seq_length: int, vocab_size: int, dtype: str | None = None) -> None:
        self.tokens = check_token_file(path, seq_length, vocab_size, dtype)
        self.seq_length = seq_length

    def batch(self, step: int, global_batch: int) -> torch.Tensor:
        n = self.seq_length + 1
        windows = len(self.tokens) // n
        rows = [(step * global_batch + i) % windows for i in range(global_batch)]
        return torch.from_numpy(np.stack([self.tokens[r * n:(r + 1) * n].astype(np.int64) for r in rows]))


def split_batch(batch: torch.Tensor, dp_rank: int, dp_size: int, micro_batch_size: int) -> list[torch.Tensor]:
    """This data-parallel rank's rows of the global batch, cut into micro-batches."""
    if batch.shape[0] % (dp_size * micro_batch_size):
        raise AutoparError("global_batch_size", batch.shape[0],
                           f"use a multiple of dp x micro_batch_size = {dp_size * micro_batch_size}",
                           problem="does not split into equal micro-batches")
    per = batch.shape[0] // dp_size
    mine = batch[dp_rank * per:(dp_rank + 1) * per]
    return list(mine.split(micro_batch_size))

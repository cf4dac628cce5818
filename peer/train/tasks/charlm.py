"""The ``charlm`` task: a small GPT learns a UTF-8 text character by character.

With ``path`` it reads that file and its vocabulary is the file's distinct characters. Without
one it trains on a corpus every machine has: the Python standard library's own source files (a
sorted, capped selection of its top-level ``.py`` files). That corpus differs a little between
Python versions, so it uses a fixed vocabulary (tab, newline and printable ASCII; anything else
reads as ``?``) and every peer builds the same model shape. Nothing is downloaded.

The first ``1 - val_fraction`` of the text trains, the rest validates; training batches are
random blocks drawn from a per-shard, per-seed generator.
"""

from __future__ import annotations

import dataclasses
import logging
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from peer.train.tasks.base import (
    Batch,
    DataShard,
    Task,
    TaskError,
    mix_seed,
    parse_options,
    seeded_build,
    worker_generator,
)
from peer.train.tasks.gpt import GPT, GPTConfig, lm_loss

logger = logging.getLogger(__name__)
STDLIB_VOCAB = "\t\n" + "".join(chr(c) for c in range(32, 127))
_UNKNOWN = "?"
_TRAIN_SALT = 0xC4A2
_EVAL_SEED = 0x5EED


@dataclasses.dataclass(frozen=True, kw_only=True)
class CharLMOptions:
    """Options of the ``charlm`` task (defaults: nanoGPT's CPU shakespeare-char configuration).

    Attributes:
        path: a UTF-8 text file; None trains on the Python standard library's source.
        max_chars: characters of the corpus kept (its beginning); None keeps a whole file and
            3,000,000 characters of the standard library.
        block_size: context length in characters.
        n_layer, n_head, n_embd, dropout, bias: the GPT's shape (see :class:`GPTConfig`).
        batch_size: blocks per local step.
        val_fraction: the end of the text kept for validation, in (0, 0.5].
        model_seed: seed of the initial weights.
        num_eval_batches: validation batches in the evaluation set.
    """

    path: str | None = None
    max_chars: int | None = None
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False
    batch_size: int = 12
    val_fraction: float = 0.1
    model_seed: int = 0
    num_eval_batches: int = 20

    def __post_init__(self) -> None:
        for name in ("block_size", "n_layer", "n_head", "n_embd", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"option {name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"option n_embd ({self.n_embd}) must be a multiple of n_head")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"option dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 < self.val_fraction <= 0.5:
            raise ValueError(f"option val_fraction must be in (0, 0.5], got {self.val_fraction}")
        if self.max_chars is not None and self.max_chars < 1:
            raise ValueError(f"option max_chars must be >= 1, got {self.max_chars}")
        if self.num_eval_batches < 0:
            raise ValueError(f"option num_eval_batches must be >= 0, got {self.num_eval_batches}")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """An encoded text: token ids, the vocabulary (id -> character) and where it came from."""

    ids: torch.Tensor
    vocab: str
    source: str

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.vocab[i] for i in ids.tolist())


def read_text(path: str | Path) -> str:
    """The whole file as text; unreadable or non-UTF-8 files raise one clear TaskError."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TaskError(f"charlm: cannot read text file {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TaskError(
            f"charlm: {path} is not UTF-8 text (bad byte at offset {e.start})"
        ) from None


def stdlib_text(max_chars: int) -> str:
    """The beginning of the standard library's top-level sources, in file-name order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if not parts:
        raise TaskError(f"charlm: no Python sources under {root}; give a text file with path=")
    return "".join(parts)[:max_chars]


def encode(text: str, vocab: str | None = None, source: str = "") -> Corpus:
    """Map characters to ids; with a fixed ``vocab``, unknown characters become ``?``."""
    codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    if vocab is None:
        table = np.unique(codepoints)
        vocab = "".join(map(chr, table.tolist()))
        ids = np.searchsorted(table, codepoints)
    else:
        table = np.array(sorted(map(ord, vocab)), dtype=np.uint32)
        vocab = "".join(map(chr, table.tolist()))
        ids = np.minimum(np.searchsorted(table, codepoints), len(table) - 1)
        ids[table[ids] != codepoints] = vocab.index(_UNKNOWN)
    return Corpus(torch.from_numpy(ids.astype(np.int32)), vocab, source)


def load_corpus(options: CharLMOptions) -> Corpus:
    """Read and encode the corpus the options name."""
    if options.path is None:
        text = stdlib_text(options.max_chars or 3_000_000)
        source = f"Python standard library source ({len(text):,} chars)"
        corpus = encode(text, STDLIB_VOCAB, source)
    else:
        text = read_text(options.path)[: options.max_chars]
        corpus = encode(text, source=f"{options.path} ({len(text):,} chars)")
    num_val = int(len(corpus.ids) * options.val_fraction)
    if min(num_val, len(corpus.ids) - num_val) <= options.block_size + 1:
        raise TaskError(
            f"charlm: {corpus.source} is too short for block_size {options.block_size} "
            f"with val_fraction {options.val_fraction}"
        )
    return corpus


class BlockDataset(IterableDataset):
    """Endless batches of random blocks: inputs ``(B, T)`` and the same shifted by one."""

    def __init__(self, ids: torch.Tensor, block_size: int, batch_size: int, shard: DataShard):
        super().__init__()
        self.ids = ids
        self.block_size = block_size
        self.batch_size = batch_size
        self.shard = shard

    def __iter__(self) -> Iterator[Batch]:
        generator = worker_generator(self.shard, _TRAIN_SALT)
        while True:
            yield sample_blocks(self.ids, self.block_size, self.batch_size, generator)


def sample_blocks(
    ids: torch.Tensor, block_size: int, batch_size: int, generator: torch.Generator
) -> Batch:
    """One batch of random blocks of ``ids`` (as nanoGPT's ``get_batch``)."""
    starts = torch.randint(len(ids) - block_size, (batch_size, 1), generator=generator)
    chunks = ids[starts + torch.arange(block_size + 1)].long()
    return chunks[:, :-1].contiguous(), chunks[:, 1:].contiguous()


def make_task(**options: Any) -> Task:
    """Build the ``charlm`` task; see :class:`CharLMOptions` for the options."""
    opts = parse_options(CharLMOptions, options, "charlm")
    corpus = load_corpus(opts)
    num_train = len(corpus.ids) - int(len(corpus.ids) * opts.val_fraction)
    train_ids, val_ids = corpus.ids[:num_train], corpus.ids[num_train:]
    config = GPTConfig(
        vocab_size=len(corpus.vocab),
        block_size=opts.block_size,
        n_layer=opts.n_layer,
        n_head=opts.n_head,
        n_embd=opts.n_embd,
        dropout=opts.dropout,
        bias=opts.bias,
    )

    def eval_batches() -> list[Batch]:
        generator = torch.Generator().manual_seed(mix_seed(_EVAL_SEED, opts.block_size))
        return [
            sample_blocks(val_ids, opts.block_size, opts.batch_size, generator)
            for _ in range(opts.num_eval_batches)
        ]

    logger.info("charlm: %s, vocabulary of %d characters", corpus.source, len(corpus.vocab))
    return Task(
        name="charlm",
        build_model=lambda: seeded_build(opts.model_seed, lambda: GPT(config)),
        train_data=lambda shard: BlockDataset(train_ids, opts.block_size, opts.batch_size, shard),
        loss_fn=lm_loss,
        batch_size=opts.batch_size,
        yields_batches=True,
        eval_batches=eval_batches if opts.num_eval_batches else None,
        description=(
            f"charlm: GPT {opts.n_layer}x{opts.n_head}x{opts.n_embd}, block {opts.block_size}, "
            f"vocab {len(corpus.vocab)}, on {corpus.source}"
        ),
    )

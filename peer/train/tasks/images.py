"""The ``images`` task: a small ResNet classifies JPEG files decoded and augmented every read.

The data-bound workload: its loader does what an image pipeline does, so that the ``data``
phase measures real preprocessing (the question of Isenko et al., SIGMOD 2022: how much of a
step goes to it, and whether loader workers win it back).

* The images are generated once, with Pillow, into a local cache (``cache_dir``; nothing is
  downloaded): each class has its own shape and colour, drawn at a random place, size and
  shade on a noisy background, saved as JPEG. A generation writes into a temporary directory
  renamed into place, so peers starting together never read a half-written cache.
* Every read opens and decodes the file, takes a random resized crop (scale ``min_scale``..1,
  aspect 3/4..4/3, as torchvision's ``RandomResizedCrop``), flips it half the time and
  normalises it. The evaluation set is a fixed centre resize of held-out files.
* The model is ResNet-like: a stem convolution, one residual block per stage with stride 2
  between stages, GroupNorm (no running statistics, so peers have nothing to average but
  parameters), global average pooling and a linear classifier.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw
from torch import nn
from torch.utils.data import Dataset, get_worker_info

from peer.train.tasks.base import (
    Batch,
    DataShard,
    Task,
    TaskError,
    mix_seed,
    parse_options,
    seeded_build,
)

logger = logging.getLogger(__name__)
SHAPES = ("circle", "square", "triangle", "cross", "ring", "bar")
# Distinct hues, one per class (wrapping with a darker shade past the palette).
PALETTE = (
    (220, 50, 47), (38, 139, 210), (133, 153, 0), (211, 54, 130), (181, 137, 0),
    (42, 161, 152), (108, 113, 196), (203, 75, 22), (90, 90, 90), (250, 250, 250),
)  # fmt: skip
MEAN = (0.5, 0.5, 0.5)
STD = (0.25, 0.25, 0.25)
_FORMAT_VERSION = 1
_AUG_SALT = 0xA06


def default_cache_dir() -> Path:
    """``$VP_CACHE_DIR/images``, else ``$XDG_CACHE_HOME`` or ``~/.cache`` + ``volunteer-peer``."""
    root = os.environ.get("VP_CACHE_DIR")
    if root:
        return Path(root) / "images"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "volunteer-peer" / "images"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImagesOptions:
    """Options of the ``images`` task.

    Attributes:
        num_classes: classes (shape x colour), at most 60.
        num_images: training JPEG files (split across the peers' shards).
        num_eval_images: held-out JPEG files of the evaluation set.
        image_size: side of the stored images, pixels.
        crop_size: side of the model's input after the random resized crop, pixels.
        min_scale: smallest crop area as a share of the image, in (0, 1].
        jpeg_quality: JPEG quality of the stored files (1-95).
        width: channels of the first stage; each later stage doubles them.
        num_stages: residual stages (each halves the resolution after the first).
        batch_size: samples per local step.
        cache_dir: where the JPEG files are generated (None: :func:`default_cache_dir`).
        data_seed: seed of the generated images.
        model_seed: seed of the initial weights.
        eval_batch_size: samples per evaluation batch.
    """

    num_classes: int = 10
    num_images: int = 2048
    num_eval_images: int = 256
    image_size: int = 256
    crop_size: int = 48
    min_scale: float = 0.35
    jpeg_quality: int = 90
    width: int = 16
    num_stages: int = 3
    batch_size: int = 32
    cache_dir: str | None = None
    data_seed: int = 0
    model_seed: int = 0
    eval_batch_size: int = 128

    def __post_init__(self) -> None:
        for name in ("num_images", "image_size", "crop_size", "width", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"option {name} must be >= 1, got {getattr(self, name)}")
        for name in ("batch_size", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"option {name} must be >= 1, got {getattr(self, name)}")
        if not 2 <= self.num_classes <= len(SHAPES) * len(PALETTE):
            raise ValueError(
                f"option num_classes must be in [2, {len(SHAPES) * len(PALETTE)}], "
                f"got {self.num_classes}"
            )
        if self.num_eval_images < 0:
            raise ValueError(f"option num_eval_images must be >= 0, got {self.num_eval_images}")
        if self.crop_size > self.image_size:
            raise ValueError(
                f"option crop_size ({self.crop_size}) must be <= image_size ({self.image_size})"
            )
        if not 0.0 < self.min_scale <= 1.0:
            raise ValueError(f"option min_scale must be in (0, 1], got {self.min_scale}")
        if not 1 <= self.jpeg_quality <= 95:
            raise ValueError(f"option jpeg_quality must be in [1, 95], got {self.jpeg_quality}")


# ---------------------------------------------------------------------------------------------
# Generating the cache


def _class_look(label: int) -> tuple[str, tuple[int, int, int]]:
    shape = SHAPES[label % len(SHAPES)]
    colour = PALETTE[(label // len(SHAPES) + label) % len(PALETTE)]
    if label >= len(PALETTE):  # more classes than hues: a darker shade tells them apart
        colour = tuple(c // 2 for c in colour)
    return shape, colour  # type: ignore[return-value]


def draw_image(label: int, size: int, rng: random.Random) -> Image.Image:
    """One image of class ``label``: its shape in its colour on a noisy background."""
    noise = np.random.default_rng(rng.getrandbits(32)).integers(0, 80, (size, size, 3))
    background = (noise + rng.randint(40, 120)).clip(0, 255).astype(np.uint8)
    image = Image.fromarray(background, "RGB")
    draw = ImageDraw.Draw(image)
    shape, colour = _class_look(label)
    shade = rng.uniform(0.75, 1.15)
    fill = tuple(min(255, int(c * shade)) for c in colour)
    radius = rng.uniform(0.18, 0.38) * size
    cx, cy = (rng.uniform(radius, size - radius) for _ in range(2))
    box = (cx - radius, cy - radius, cx + radius, cy + radius)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        corners = [(cx, cy - radius), (cx - radius, cy + radius), (cx + radius, cy + radius)]
        draw.polygon(corners, fill=fill)
    elif shape == "cross":
        bar = radius / 3
        draw.rectangle((cx - radius, cy - bar, cx + radius, cy + bar), fill=fill)
        draw.rectangle((cx - bar, cy - radius, cx + bar, cy + radius), fill=fill)
    elif shape == "ring":
        draw.ellipse(box, outline=fill, width=max(2, int(radius / 3)))
    else:
        draw.rectangle((cx - radius, cy - radius / 4, cx + radius, cy + radius / 4), fill=fill)
    return image


def _cache_key(opts: ImagesOptions) -> str:
    fields = (
        _FORMAT_VERSION, opts.num_classes, opts.num_images, opts.num_eval_images,
        opts.image_size, opts.jpeg_quality, opts.data_seed,
    )  # fmt: skip
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:12]


def _generate(directory: Path, opts: ImagesOptions) -> None:
    rng = random.Random(mix_seed(opts.data_seed, 0x1A6E))
    for split, count in (("train", opts.num_images), ("eval", opts.num_eval_images)):
        (directory / split).mkdir(parents=True)
        for number in range(count):
            label = number % opts.num_classes
            image = draw_image(label, opts.image_size, rng)
            image.save(directory / split / f"{number:06d}_{label}.jpg", quality=opts.jpeg_quality)


def ensure_cache(opts: ImagesOptions) -> Path:
    """The directory of the options' images, generated first if absent (safe to race)."""
    root = Path(opts.cache_dir) if opts.cache_dir else default_cache_dir()
    directory = root / f"shapes-{_cache_key(opts)}"
    if (directory / "done").is_file():
        return directory
    try:
        root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".generating-", dir=root))
    except OSError as e:
        raise TaskError(f"images: cannot create cache directory {root}: {e.strerror or e}") from e
    try:
        logger.info("images: generating %d JPEG files into %s", opts.num_images, directory)
        _generate(scratch, opts)
        (scratch / "done").write_text("ok\n")
        with contextlib.suppress(OSError):  # another process won the race: use its copy
            scratch.rename(directory)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if not (directory / "done").is_file():
        raise TaskError(f"images: cache {directory} is incomplete; remove it and retry")
    return directory


def list_split(directory: Path, split: str) -> list[tuple[Path, int]]:
    """``(file, label)`` of one split, in file-name order."""
    files = sorted((directory / split).glob("*.jpg"))
    return [(path, int(path.stem.rpartition("_")[2])) for path in files]


# ---------------------------------------------------------------------------------------------
# Decoding and augmenting


def to_tensor(image: Image.Image) -> torch.Tensor:
    """A normalised CHW float tensor of an RGB image."""
    array = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy())
    pixels = array.permute(2, 0, 1).float().div_(255.0)
    mean = torch.tensor(MEAN).view(3, 1, 1)
    std = torch.tensor(STD).view(3, 1, 1)
    return pixels.sub_(mean).div_(std)


def crop_box(width: int, height: int, min_scale: float, rng: random.Random) -> tuple[int, ...]:
    """A random crop's box (left, top, right, bottom), as torchvision's RandomResizedCrop."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(min_scale, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left, top = rng.randint(0, width - w), rng.randint(0, height - h)
            return left, top, left + w, top + h
    return 0, 0, width, height


class JpegDataset(Dataset):
    """Training samples: every ``__getitem__`` decodes a file and augments it afresh."""

    def __init__(self, files: list[tuple[Path, int]], opts: ImagesOptions, shard: DataShard):
        self.files = files
        self.opts = opts
        self.shard = shard
        self._rng: random.Random | None = None
        self._worker_id: int | None = None

    def __len__(self) -> int:
        return len(self.files)

    def _generator(self) -> random.Random:
        # Seeded on first use in each loader worker: every worker of every peer augments alike
        # for the same (seed, shard, worker), and differently from the others.
        info = get_worker_info()
        worker_id = 0 if info is None else info.id
        if self._rng is None or worker_id != self._worker_id:
            seed = mix_seed(self.shard.seed, self.shard.index, worker_id, _AUG_SALT)
            self._rng, self._worker_id = random.Random(seed), worker_id
        return self._rng

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.files[index]
        rng = self._generator()
        with Image.open(path) as file:
            image = file.convert("RGB")
        size = self.opts.crop_size
        box = crop_box(image.width, image.height, self.opts.min_scale, rng)
        image = image.resize((size, size), Image.Resampling.BILINEAR, box=box)
        if rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return to_tensor(image), label


def eval_batches(files: list[tuple[Path, int]], opts: ImagesOptions) -> list[Batch]:
    """The evaluation set: held-out files resized whole to the crop size, no augmentation."""
    samples = []
    for path, label in files:
        with Image.open(path) as file:
            image = file.convert("RGB").resize((opts.crop_size,) * 2, Image.Resampling.BILINEAR)
        samples.append((to_tensor(image), label))
    step = opts.eval_batch_size
    return [
        (
            torch.stack([s[0] for s in samples[i : i + step]]),
            torch.tensor([s[1] for s in samples[i : i + step]]),
        )
        for i in range(0, len(samples), step)
    ]


# ---------------------------------------------------------------------------------------------
# The model


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(math.gcd(8, channels), channels)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (a projection when the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.norm1 = _norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.norm2 = _norm(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), _norm(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    """Stem (3x3 conv, stride 2), ``num_stages`` residual blocks, pooling, linear classifier."""

    def __init__(self, num_classes: int, width: int, num_stages: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), _norm(width), nn.ReLU())
        blocks, channels = [], width
        for stage in range(num_stages):
            out_channels = width * 2**stage
            blocks.append(BasicBlock(channels, out_channels, 1 if stage == 0 else 2))
            channels = out_channels
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(x))
        return self.head(features.mean(dim=(2, 3)))


def make_task(**options: Any) -> Task:
    """Build the ``images`` task; see :class:`ImagesOptions` for the options."""
    opts = parse_options(ImagesOptions, options, "images")
    directory = ensure_cache(opts)
    train_files = list_split(directory, "train")
    held_out = list_split(directory, "eval")
    if len(train_files) != opts.num_images:
        raise TaskError(f"images: cache {directory} has {len(train_files)} training files")
    return Task(
        name="images",
        build_model=lambda: seeded_build(
            opts.model_seed, lambda: SmallResNet(opts.num_classes, opts.width, opts.num_stages)
        ),
        train_data=lambda shard: JpegDataset(train_files, opts, shard),
        loss_fn=F.cross_entropy,
        batch_size=opts.batch_size,
        eval_batches=(lambda: eval_batches(held_out, opts)) if held_out else None,
        description=(
            f"images: ResNet width {opts.width} x {opts.num_stages} stages on "
            f"{opts.num_images} JPEGs {opts.image_size}px, {opts.num_classes} classes, crop "
            f"{opts.crop_size}px, batch {opts.batch_size}"
        ),
    )

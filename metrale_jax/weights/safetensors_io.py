"""Safetensors reading and writing for every dtype the checkpoints use (BF16 and F8_E4M3 included).

Reading memory-maps the file and hands out one tensor at a time as a numpy view (ml_dtypes for
bfloat16 / float8), so no whole-file copy is made. A directory is read through its
`model.safetensors.index.json` when present, else its `model.safetensors`, else every `*.safetensors`.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
import safetensors

from metrale_jax import files
from metrale_jax.errors import CheckpointError
from metrale_jax.files import open_regular, read_json
from metrale_jax.tokenizer import BYTE_TOKENIZER_FILE, TOKENIZER_CONFIG_FILE

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsFile:
    """One .safetensors file, memory-mapped; tensors come out as read-only numpy views.

    The header is checked by the `safetensors` library itself (header-only: it maps the file, reads no tensor
    data): valid UTF-8 JSON of the right structure, known dtypes, offsets that are non-negative integers, do
    not overlap, leave no gap and cover the data exactly. Its problems come out as CheckpointError naming the
    file (and the tensor, where the library names it)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fh = open_regular(self.path)                 # a FIFO / device / directory is refused, unopened
        try:
            listing, metadata = _library_listing(self.path)
            size = os.fstat(self._fh.fileno()).st_size
            (n,) = struct.unpack("<Q", self._fh.read(8))
            header = json.loads(self._fh.read(n))          # the same bytes the library just validated
        except BaseException:
            self._fh.close()
            raise
        header.pop("__metadata__", None)
        self.metadata = metadata or {}
        self._header = header
        self._base = 8 + n
        _check_listing(self.path, header, listing)
        self._map = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None

    def keys(self) -> list[str]:
        return list(self._header)

    def __contains__(self, name: str) -> bool:
        return name in self._header

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype name, shape) without reading the data."""
        h = self._header[name]
        return h["dtype"], tuple(h["shape"])

    def get(self, name: str) -> np.ndarray:
        h = self._header[name]
        begin, end = h["data_offsets"]
        dtype = DTYPES[h["dtype"]]
        if end == begin:
            return np.zeros(h["shape"], dtype)
        return np.frombuffer(self._map, dtype=dtype, count=(end - begin) // dtype.itemsize,
                             offset=self._base + begin).reshape(h["shape"])

    def close(self) -> None:
        self._map = None  # views keep the map alive until they are dropped
        self._fh.close()


def _library_listing(path: Path) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict | None]:
    """{name: (dtype, shape)} and the metadata of a safetensors file, as the `safetensors` library reads its
    header (which validates it: see SafetensorsFile). Only the header is parsed; the data stays unread."""
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            listing = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
            return listing, f.metadata()
    except (safetensors.SafetensorError, OSError, ValueError) as e:
        why = " ".join(str(e).split()) or type(e).__name__
        suspect = _malformed_entry(path)
        raise CheckpointError(f"{path}: not a valid safetensors file ({why})"
                              + (f"; tensor {suspect}" if suspect else "")) from None


def _malformed_entry(path: Path) -> str | None:
    """For the message only, once the library has refused a header: the first entry that is not of the form
    {"dtype": name, "shape": [n, ...], "data_offsets": [begin, end]} with end - begin the shape's bytes, as
    'name: why' (None when every entry has that form, or the header is not a JSON object at all)."""
    try:
        with open_regular(path) as fh:
            head = fh.read(8)
            header = json.loads(fh.read(min(struct.unpack("<Q", head)[0], 100 * 1024 ** 2)))
    except (CheckpointError, OSError, ValueError, RecursionError, struct.error):
        return None
    if not isinstance(header, dict):
        return None
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            return f"{name}: expected {{dtype, shape, data_offsets}}, got {info!r:.80}"
        shape, offsets = info["shape"], info["data_offsets"]
        if not _naturals(shape) or not _naturals(offsets) or len(offsets) != 2:
            return f"{name}: shape {shape!r:.40} and data_offsets {offsets!r:.40} must be non-negative integers"
        if info["dtype"] not in DTYPES:
            return f"{name}: unsupported dtype {info['dtype']!r:.40}"
        if offsets[1] - offsets[0] != math.prod(shape) * DTYPES[info["dtype"]].itemsize:
            return f"{name}: data_offsets {offsets} do not hold shape {shape} of {info['dtype']}"
    return None


def _naturals(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def _check_listing(path: Path, header: dict, listing: dict) -> None:
    """Our reading of the header agrees with the library's (names, dtypes, shapes), and every dtype is one
    this module maps to numpy."""
    ours = {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()}
    if ours != listing:
        raise CheckpointError(f"{path}: the header reads differently here than in the safetensors library")
    for name, (dtype, _) in ours.items():
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {dtype!r}; expected one of "
                                  f"{', '.join(DTYPES)}")


INDEX = "model.safetensors.index.json"
# the files of a checkpoint directory besides its model*.safetensors (see is_checkpoint_file)
CHECKPOINT_FILES = ("config.json", "hf_quant_config.json", INDEX, "tokenizer.json", BYTE_TOKENIZER_FILE,
                    TOKENIZER_CONFIG_FILE)


def is_checkpoint_file(name: str) -> bool:
    """Whether a directory entry belongs to the checkpoint the loader reads (weights, index, configs, tokenizer):
    what writing a new checkpoint over a directory replaces (files.staged_directory)."""
    return name in CHECKPOINT_FILES or (name.startswith("model") and name.endswith(".safetensors"))


def read_index(directory: Path) -> dict[str, Path]:
    """{tensor: shard path} from directory's model.safetensors.index.json. Each shard must be named by a plain
    file name (no directory part, no "..", not absolute), so that nothing outside the directory is opened by
    name; the file it names may be a symlink (as the HF cache makes them), and must be a regular file."""
    index = directory / INDEX
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: weight_map: expected an object {{tensor: shard file}}, got "
                              f"{type(weight_map).__name__}")
    bad: dict[str, list[str]] = {}                              # one problem per bad shard name, not per tensor
    for tensor, name in weight_map.items():
        if (why := shard_name_problem(name)) is not None:
            bad.setdefault(why, []).append(tensor)
    if bad:
        raise CheckpointError([f"{index}: weight_map gives {len(ts)} tensor(s) ({ts[0]}, ...) a shard name that "
                               f"is not usable: {why}" for why, ts in bad.items()])
    problems = []
    for name in sorted(set(weight_map.values())):
        if not os.path.lexists(directory / name):
            problems.append(f"{index}: names shard {name}, which does not exist")
        elif not (directory / name).is_file():
            problems.append(f"{index}: names shard {name}, which is not a regular file")
    if problems:
        raise CheckpointError(problems)
    return {k: directory / f for k, f in weight_map.items()}


def shard_name_problem(name) -> str | None:
    """Why `name` is not a plain file name of the directory (None when it is one)."""
    if not isinstance(name, str):
        return f"expected a file name, got {type(name).__name__} {name!r}"[:200]
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name or os.path.isabs(name):
        return f"{name!r} is not a plain file name inside the checkpoint directory"
    return None


class CheckpointReader:
    """All tensors of a checkpoint directory (sharded or not) by name."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory")
        index = self.directory / INDEX
        self._where: dict[str, Path] = {}
        if os.path.lexists(index):
            self._where = read_index(self.directory)
        else:
            single = self.directory / "model.safetensors"
            files = [single] if os.path.lexists(single) else sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.directory}: no model.safetensors or *.safetensors files")
            listings = []
            for f in files:
                st = SafetensorsFile(f)
                listings.append((f, st.keys()))
                st.close()
            self._where = place_tensors(listings)
        self._open: dict[Path, SafetensorsFile] = {}

    def _file(self, path: Path) -> SafetensorsFile:
        if path not in self._open:
            self._open[path] = SafetensorsFile(path)
        return self._open[path]

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        return self._holding(name).info(name)

    def get(self, name: str) -> np.ndarray:
        return self._holding(name).get(name)

    def _holding(self, name: str) -> SafetensorsFile:
        """The open file the index places `name` in; CheckpointError when that file does not hold it."""
        f = self._file(self._where[name])
        if name not in f:
            raise CheckpointError(f"{f.path}: the index places {name} here, but the file does not hold it")
        return f

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self._where:
            yield name, self.get(name)

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


def place_tensors(listings: list[tuple[Path, list[str]]]) -> dict[str, Path]:
    """{tensor: file} from (file, its tensor names) of a directory read without an index; a tensor held by more
    than one file is a CheckpointError naming it and the files (which copy is meant is not known)."""
    where: dict[str, Path] = {}
    twice: dict[str, list[Path]] = {}
    for path, names in listings:
        for name in names:
            if name in where:
                twice.setdefault(name, [where[name]]).append(path)
            else:
                where[name] = path
    if twice:
        raise CheckpointError([f"{name}: held by {len(paths)} files ({', '.join(str(p) for p in paths)}); "
                               f"expected one (or a {INDEX} saying which)" for name, paths in sorted(twice.items())])
    return where


def save_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                     metadata: Mapping[str, str] | None = None) -> None:
    """Write tensors (numpy arrays, any dtype in DTYPES) to one .safetensors file."""
    header: dict = {}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in _NAMES:
            raise CheckpointError(f"{name}: dtype {arr.dtype} cannot be written to safetensors")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with files.replacing(path) as fh:                      # `path` is the old file or the whole new one
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for arr in arrays:
            fh.write(arr.tobytes())

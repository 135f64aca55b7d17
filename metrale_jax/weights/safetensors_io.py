"""Safetensors reading and writing for every dtype the checkpoints use (BF16 and F8_E4M3 included).

Reading memory-maps the file and hands out one tensor at a time as a numpy view (ml_dtypes for
bfloat16 / float8), so no whole-file copy is made. A directory is read through its
`model.safetensors.index.json` when present, else its `model.safetensors`, else every `*.safetensors`.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from metrale_jax.errors import CheckpointError

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsFile:
    """One .safetensors file, memory-mapped; tensors come out as read-only numpy views."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._fh = open(self.path, "rb")
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open ({e.strerror})") from None
        size = os.fstat(self._fh.fileno()).st_size
        head = self._fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{self.path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{self.path}: header length {n} runs past the end of the file")
        try:
            header = json.loads(self._fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: header is not valid JSON ({e})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self._header = header
        self._base = 8 + n
        self._map = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None
        for name, info in header.items():
            if info.get("dtype") not in DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
            begin, end = info["data_offsets"]
            want = int(np.prod(info["shape"], dtype=np.int64)) * DTYPES[info["dtype"]].itemsize
            if end - begin != want or self._base + end > size:
                raise CheckpointError(f"{self.path}: tensor {name} has data offsets {info['data_offsets']} that do "
                                      f"not fit its shape {info['shape']} and dtype {info['dtype']}")

    def keys(self) -> list[str]:
        return list(self._header)

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


class CheckpointReader:
    """All tensors of a checkpoint directory (sharded or not) by name."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory")
        index = self.directory / "model.safetensors.index.json"
        self._where: dict[str, Path] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
            missing = sorted({f for f in weight_map.values() if not (self.directory / f).is_file()})
            if missing:
                raise CheckpointError([f"{index}: names shard {f}, which does not exist" for f in missing])
            self._where = {k: self.directory / f for k, f in weight_map.items()}
        else:
            single = self.directory / "model.safetensors"
            files = [single] if single.is_file() else sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.directory}: no model.safetensors or *.safetensors files")
            for f in files:
                for k in SafetensorsFile(f).keys():
                    self._where[k] = f
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
        return self._file(self._where[name]).info(name)

    def get(self, name: str) -> np.ndarray:
        f = self._file(self._where[name])
        if name not in f.keys():
            raise CheckpointError(f"{f.path}: the index places {name} here, but the file does not hold it")
        return f.get(name)

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self._where:
            yield name, self.get(name)

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


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
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for arr in arrays:
            fh.write(arr.tobytes())
    os.replace(tmp, path)

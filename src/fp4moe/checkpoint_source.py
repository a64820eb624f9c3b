"""A checkpoint's keys, and reading a chosen few of its tensors: a safetensors file, an HF
sharded directory (``model.safetensors.index.json``) or a state dict. Headers are parsed
here (no memory map, no safetensors dependency), so a loader holds only what it reads.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["CheckpointSource", "read_safetensors_header"]

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def read_safetensors_header(
    file: str,
) -> tuple[dict[str, tuple[torch.dtype, tuple, int, int]], int]:
    """The tensors of a safetensors file from its header: ``{key: (dtype, shape, begin,
    end)}`` (byte offsets into the data) and where the data starts. Nothing else is read.

    Raises:
        ValueError: a file too short for its header, a header that is not the format's
            JSON, an unsupported dtype, or offsets that do not fit the shape or the file.
    """
    size = os.path.getsize(file)
    bad = f"source: {file!r} is truncated or not a safetensors file"
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= n <= size - 8:
            raise ValueError(f"{bad} (header size {n}, file size {size})")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ValueError(f"{bad} ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{bad} (the header is not a JSON object)")
    start, data = 8 + n, size - 8 - n
    out: dict[str, tuple[torch.dtype, tuple, int, int]] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{bad} (entry {key!r}: {exc!r})") from None
        nbytes = dtype.itemsize * math.prod(shape)
        if not 0 <= begin <= end <= data or end - begin != nbytes:
            raise ValueError(f"{bad} (entry {key!r}: offsets {begin}..{end} of {data} bytes)")
        out[key] = (dtype, shape, begin, end)
    return out, start


class CheckpointSource:
    """The keys of a checkpoint, and reading a chosen few of them.

    Args:
        source: a safetensors file; a directory with ``model.safetensors.index.json`` (HF
            sharded layout) or a single ``model.safetensors``; or a state dict
            ``dict[str, Tensor]``.

    Each shard's header is read once; a tensor is read with one ``readinto`` into its own
    new CPU tensor (files are not memory-mapped, so the process holds only the tensors it
    read: host memory measures what a loader keeps). Use as a context manager (``with
    CheckpointSource(path) as src:``); :meth:`close` forgets the headers.
    """

    def __init__(self, source: Any) -> None:
        self._dict: Mapping[str, torch.Tensor] | None = None
        self._key_to_file: dict[str, str] = {}
        self._headers: dict[str, tuple[dict, int]] = {}  # file -> (entries, data start)
        self.folder: str | None = None  # the checkpoint directory, when given one
        if isinstance(source, Mapping):
            for k, v in source.items():
                if not isinstance(k, str):
                    raise TypeError(f"source: state dict keys must be str, got {type(k).__name__}")
                if not isinstance(v, torch.Tensor):
                    raise TypeError(
                        f"source: state dict value {k!r} must be a torch.Tensor, "
                        f"got {type(v).__name__}"
                    )
            self._dict = source
            self.description = "the state dict"
            return
        if not isinstance(source, (str, os.PathLike)):
            raise TypeError(
                "source: expected a path (file or directory) or a dict[str, Tensor], "
                f"got {type(source).__name__}"
            )
        path = os.fspath(source)
        self.description = repr(path)
        if os.path.isfile(path):
            self._map_whole_file(path)
        elif os.path.isdir(path):
            self.folder = path
            index = os.path.join(path, "model.safetensors.index.json")
            single = os.path.join(path, "model.safetensors")
            if os.path.isfile(index):
                self._map_index(index, path)
            elif os.path.isfile(single):
                self._map_whole_file(single)
            else:
                found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[:5]
                raise ValueError(
                    f"source: directory {path!r} holds neither model.safetensors.index.json "
                    f"nor model.safetensors (safetensors files found: {found})"
                )
        else:
            raise ValueError(f"source: no such file or directory {path!r}")

    def __enter__(self) -> CheckpointSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Forget the headers read (no file stays open between reads)."""
        self._headers.clear()

    def _header(self, file: str, key: str | None = None) -> tuple[dict, int]:
        if file not in self._headers:
            if not os.path.isfile(file):
                what = f"the index maps {key!r} to {file!r}" if key else repr(file)
                raise ValueError(f"source: {what}, which does not exist")
            self._headers[file] = read_safetensors_header(file)
        return self._headers[file]

    def _map_whole_file(self, file: str) -> None:
        entries, _ = self._header(file)
        self._key_to_file = dict.fromkeys(entries, file)

    def _map_index(self, index: str, folder: str) -> None:
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"source: {index!r} is not a valid safetensors index ({exc})") from exc
        if not isinstance(weight_map, dict):
            raise ValueError(f"source: {index!r}: weight_map must be an object")
        self._key_to_file = {k: os.path.join(folder, v) for k, v in weight_map.items()}

    def has(self, key: str) -> bool:
        """Whether the checkpoint holds ``key``."""
        return key in (self._dict if self._dict is not None else self._key_to_file)

    def all_keys(self) -> Iterable[str]:
        """Every key of the checkpoint."""
        return self._dict.keys() if self._dict is not None else self._key_to_file.keys()

    def _entry(self, key: str) -> tuple[torch.dtype, tuple, int, int, int, str]:
        file = self._key_to_file[key]
        entries, start = self._header(file, key)
        if key not in entries:
            raise ValueError(f"source: the index maps {key!r} to {file!r}, which does not hold it")
        return (*entries[key], start, file)

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """(dtype, shape) of ``key`` (from the file header: nothing is read)."""
        if self._dict is not None:
            t = self._dict[key]
            return t.dtype, tuple(t.shape)
        dtype, shape, *_ = self._entry(key)
        return dtype, shape

    def nbytes(self) -> int:
        """Bytes of all the checkpoint's tensors (from the headers)."""
        return sum(d.itemsize * math.prod(s) for d, s in map(self.info, self.all_keys()))

    def read(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        """The tensors of ``keys`` (all present: check with :meth:`has` first), new CPU
        tensors (the state dict's own, for a state dict)."""
        if self._dict is not None:
            return {k: self._dict[k] for k in keys}
        out: dict[str, torch.Tensor] = {}
        for k in sorted(keys, key=lambda k: self._key_to_file[k]):
            dtype, shape, begin, end, start, file = self._entry(k)
            raw = torch.empty(end - begin, dtype=torch.uint8)
            with open(file, "rb", buffering=0) as f:
                f.seek(start + begin)
                got = f.readinto(memoryview(raw.numpy())) if end > begin else 0
            if got != end - begin:
                raise ValueError(f"source: {file!r} is truncated ({k!r} ends past the file)")
            out[k] = raw.view(dtype).reshape(shape)
        return {k: out[k] for k in keys}

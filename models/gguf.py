"""Load a llama.cpp GGUF file: dequantise once, cache as safetensors, build the model.

llama-arch files store the q/k projection rows permuted for llama.cpp's interleaved rotary layout;
they are kept as stored and the config says `rope_layout='interleaved'`. qwen2/qwen3 files use
the half-split (NeoX) layout. A separate `output.weight` makes the model untied.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import pathlib
import re
import struct
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np
import safetensors
import tqdm
from jax.sharding import Mesh

from jaxcert.base import paths
from jaxcert.base.folders import atomic_file
from jaxcert.models._tokenizer import tokenizer_from_gguf
from jaxcert.models._weights import LoadedModel, hf_layout, model_from_tensors
from jaxcert.models.config import ModelConfig
from jaxcert.models.sharding import LOGICAL_RULES

_CACHE_VERSION = "2"
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    **{f"attn_{x}.{p}": f"self_attn.{x}_proj.{p}" for x in "qkv" for p in ("weight", "bias")},
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def hf_name(name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor name.

    Raises:
      ValueError: a tensor this package does not know (e.g. `rope_freqs.weight`).
    """
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    raise ValueError(f"Unsupported GGUF tensor {name!r}.")


def read_gguf(path: str | os.PathLike) -> tuple[gguf.GGUFReader, dict[str, Any]]:
    """Opens a GGUF file: `(reader, metadata)` with metadata as plain Python values.

    Raises:
      ValueError: the file is missing, truncated or not a GGUF file (the message names it).
    """
    path = pathlib.Path(path)
    try:
        reader = gguf.GGUFReader(path)
        metadata = {key: field.contents() for key, field in reader.fields.items()}
    except Exception as e:
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}).") from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"{path}: truncated GGUF file (tensor {t.name!r} ends past the end).")
    return reader, metadata


@dataclasses.dataclass(frozen=True)
class ArrayHeader:
    """An array value of a GGUF header whose elements were skipped (:func:`read_gguf_header`).

    Attributes:
      type: the elements' `gguf.GGUFValueType`.
      count: the number of elements (also ``len()``).
    """

    type: gguf.GGUFValueType
    count: int

    def __len__(self) -> int:
        return self.count


_V = gguf.GGUFValueType
_SCALAR_FORMATS = {
    _V.UINT8: "<B",
    _V.INT8: "<b",
    _V.UINT16: "<H",
    _V.INT16: "<h",
    _V.UINT32: "<I",
    _V.INT32: "<i",
    _V.FLOAT32: "<f",
    _V.BOOL: "<?",
    _V.UINT64: "<Q",
    _V.INT64: "<q",
    _V.FLOAT64: "<d",
}


class _Header:
    """A little-endian cursor over the bytes of a GGUF file."""

    def __init__(self, buf):
        self.buf, self.offset = buf, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("<Q")
        if self.offset + size > len(self.buf):
            raise struct.error("string past the end of the file")
        text = bytes(self.buf[self.offset : self.offset + size]).decode("utf-8", "replace")
        self.offset += size
        return text

    def skip(self, kind: gguf.GGUFValueType, count: int) -> None:
        """Skips ``count`` values of type ``kind`` (arrays of arrays included)."""
        if kind in _SCALAR_FORMATS:
            self.offset += count * struct.calcsize(_SCALAR_FORMATS[kind])
        elif kind == _V.STRING:
            for _ in range(count):
                size = self.scalar("<Q")  # moves past the length
                self.offset += size
        elif kind == _V.ARRAY:
            for _ in range(count):
                inner = _V(self.scalar("<I"))
                self.skip(inner, self.scalar("<Q"))
        else:
            raise ValueError(f"unknown GGUF value type {kind}")
        if self.offset > len(self.buf):
            raise struct.error("array past the end of the file")

    def value(self, kind: gguf.GGUFValueType):
        if kind in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[kind])
        if kind == _V.STRING:
            return self.string()
        if kind == _V.ARRAY:
            inner, count = _V(self.scalar("<I")), self.scalar("<Q")
            self.skip(inner, count)
            return ArrayHeader(inner, count)
        raise ValueError(f"unknown GGUF value type {kind}")


def read_gguf_header(path: str | os.PathLike) -> tuple[dict[str, Any], list[str]]:
    """The metadata and tensor names of a GGUF file (version 2 or 3), from its header alone.

    Much cheaper than :func:`read_gguf` (whose parse of a 151,936-token vocabulary takes
    seconds): the elements of array values are skipped, not converted, and no tensor data
    is touched. Enough for `ModelConfig.from_gguf` (the vocabulary size is the token
    list's length when the file has no ``<arch>.vocab_size``).

    Returns:
      ``(metadata, tensor_names)``: scalars and strings as Python values, each array as an
      :class:`ArrayHeader` (element type and length); the tensors' names in file order.

    Raises:
      ValueError: not a GGUF file, another version or byte order, or a truncated header
        (the message names the file).
    """
    path = pathlib.Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            header = _Header(buf)
            if bytes(buf[:4]) != b"GGUF":
                raise ValueError("no GGUF magic")
            header.offset = 4
            version = header.scalar("<I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (this reader knows 2 and 3)")
            tensors, fields = header.scalar("<Q"), header.scalar("<Q")
            # The keys gguf.GGUFReader adds for the header itself, as `read_gguf` has them.
            metadata = {"GGUF.version": version, "GGUF.tensor_count": tensors}
            metadata["GGUF.kv_count"] = fields
            for _ in range(fields):
                key = header.string()
                metadata[key] = header.value(_V(header.scalar("<I")))
            names = []
            for _ in range(tensors):
                names.append(header.string())
                dims = header.scalar("<I")
                header.offset += 8 * dims + 4 + 8  # shape, tensor type, data offset
            if header.offset > len(buf):
                raise struct.error("tensor table past the end of the file")
    except (ValueError, struct.error, OSError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}).") from e
    return metadata, names


def gguf_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of a GGUF file, from its header: no weights are read or dequantised.

    Raises:
      ValueError: no such file, an unreadable file, or an unsupported architecture or setting
        (see `ModelConfig.from_gguf`).
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such GGUF file.")
    try:
        metadata, names = read_gguf_header(path)
    except ValueError:  # e.g. a byte order this reader does not know: gguf's full parse
        reader, metadata = read_gguf(path)
        names = [t.name for t in reader.tensors]
    return ModelConfig.from_gguf(metadata, tensor_names=names)


def dequant_cache_path(path: str | os.PathLike, dtype, cache_dir=None) -> pathlib.Path:
    """The cache file for `path` in `dtype`, keyed by (realpath, size, mtime, dtype)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    name = jnp.dtype(dtype).name
    key = f"{real}\0{st.st_size}\0{st.st_mtime_ns}\0{name}\0{_CACHE_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    if cache_dir is None:
        cache_dir = paths.cache_dir()
    root = pathlib.Path(cache_dir)
    return root / "dequant" / f"{pathlib.Path(real).stem}-{name}-{digest}.safetensors"


def _dequantize(t: gguf.ReaderTensor, dtype: np.dtype, source: pathlib.Path) -> np.ndarray:
    try:
        x = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(
            f"{source}: tensor {t.name!r} has unsupported type {t.tensor_type.name}."
        ) from e
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return np.ascontiguousarray(x.reshape(shape), dtype=dtype)


def _plain(x):
    """JSON fallback for numpy values in GGUF metadata."""
    return x.tolist() if hasattr(x, "tolist") else str(x)


def write_dequantized(
    reader: gguf.GGUFReader, out: pathlib.Path, dtype, *, source, metadata: Mapping[str, Any]
) -> None:
    """Dequantises every tensor into a safetensors file at `out`, one tensor in memory at a time.

    Writes a hidden `.out.*.tmp` first and renames it, so a partial file is never seen under
    `out`.
    Tensors get their Hugging Face names (`hf_name`); the header keeps the GGUF metadata and
    tensor names, so a cached load never parses the GGUF file again (6 s for Qwen's vocabulary).
    """
    np_dtype = np.dtype(jnp.dtype(dtype))
    if np_dtype.name not in _SAFETENSORS_DTYPES:
        raise ValueError(f"Unsupported cache dtype {np_dtype.name}.")
    header, offset = {}, 0
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape.tolist())]
        nbytes = int(np.prod(shape)) * np_dtype.itemsize
        header[hf_name(t.name)] = {
            "dtype": _SAFETENSORS_DTYPES[np_dtype.name],
            "shape": shape,
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = {
        "source": str(source),
        "format": f"jaxcert-dequant-{_CACHE_VERSION}",
        "gguf_metadata": json.dumps(dict(metadata), default=_plain),
        "gguf_tensors": json.dumps([t.name for t in reader.tensors]),
    }
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out, fsync=False) as tmp, open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        bar = tqdm.tqdm(
            reader.tensors,
            desc=f"dequantising {pathlib.Path(source).name} (once; cached)",
            unit="tensor",
            file=sys.stderr,
            leave=False,
        )
        for t in bar:
            f.write(_dequantize(t, np_dtype, source).tobytes())


class _SafetensorsFile(Mapping):
    """Lazy name -> numpy array view of a dequantised cache file, with the GGUF's metadata."""

    def __init__(self, path: pathlib.Path):
        self._file = safetensors.safe_open(path, framework="numpy")
        self._names = list(self._file.keys())
        extra = self._file.metadata() or {}
        self.gguf_metadata = json.loads(extra["gguf_metadata"])
        self.gguf_tensor_names = json.loads(extra["gguf_tensors"])

    def __getitem__(self, name: str) -> np.ndarray:
        return self._file.get_tensor(name)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def load_gguf(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    cache_dir: str | os.PathLike | None = None,
    mesh: Mesh | None = None,
    rules=LOGICAL_RULES,
) -> LoadedModel:
    """Loads a llama / qwen2 / qwen3 GGUF file (F32, F16, BF16 and the quantised types
    `gguf.quants` dequantises: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K ... Q6_K).

    The dequantised weights are cached as `<cache_dir>/dequant/<stem>-<dtype>-<key>.safetensors`
    (key: realpath, size, mtime, dtype); later loads read that file instead of dequantising.

    Args:
      path: the `.gguf` file.
      dtype: parameter and compute dtype (and the cache file's dtype).
      cache_dir: cache root; default `jaxcert.base.paths.cache_dir()`.
      mesh: place each weight directly on its shards of this `jax.sharding.Mesh` (``Auto``
        axes) as it is read; see `model_from_tensors` and `jaxcert.models.shard`.
      rules: logical -> mesh axis rules, with `mesh` (default `LOGICAL_RULES`).

    Returns:
      A `LoadedModel` whose tokenizer is built from the file's metadata (no torch needed).

    Raises:
      ValueError: unreadable / truncated file, unsupported architecture, tokenizer or tensor
        type, an unknown or missing tensor (named), a shape mismatch, or an ``Explicit`` mesh.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such GGUF file.")
    cache_file = dequant_cache_path(path, dtype, cache_dir)
    tensors: Mapping[str, Any] | None = None
    if cache_file.is_file():
        try:
            tensors = _SafetensorsFile(cache_file)
            metadata, names = tensors.gguf_metadata, tensors.gguf_tensor_names
        except Exception as e:  # damaged by hand: rebuild it
            warnings.warn(f"Rebuilding unreadable cache {cache_file}: {e}", stacklevel=2)
            cache_file.unlink(missing_ok=True)
            tensors = None
    if tensors is None:
        reader, metadata = read_gguf(path)
        names = [t.name for t in reader.tensors]
    config = ModelConfig.from_gguf(metadata, tensor_names=names)
    missing = sorted(set(hf_layout(config)) - {hf_name(n) for n in names})
    if missing:
        raise ValueError(f"{path}: missing tensor(s) for {config.architecture}: {missing[:8]}.")
    tokenizer = tokenizer_from_gguf(metadata)
    if tensors is None:
        try:
            write_dequantized(reader, cache_file, dtype, source=path, metadata=metadata)
            tensors = _SafetensorsFile(cache_file)
        except OSError as e:  # read-only or full cache: dequantise in memory instead
            warnings.warn(f"Not caching dequantised {path} at {cache_file}: {e}", stacklevel=2)
            np_dtype = np.dtype(jnp.dtype(dtype))
            tensors = {hf_name(t.name): _dequantize(t, np_dtype, path) for t in reader.tensors}
        del reader
    model = model_from_tensors(
        config, tensors, dtype=dtype, source=str(path), mesh=mesh, rules=rules
    )
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=path)

"""Reading a GGUF file: its metadata, its tensor table, and dequantised tensors.

`gguf.GGUFReader` parses every metadata field eagerly, including the ~100k token and merge strings,
which takes seconds on every load although the model needs none of them (the tokenizer is cached
separately). So the first load of a file keeps what the reader found (scalar fields, the tensor
table with byte offsets) as a small JSON index in the cache, keyed by the file's path, size and
mtime; later loads memory-map the file and slice tensors straight from that index. Dequantisation
always goes through the gguf package's own dequantisers.

A file that cannot be read is refused with a `GGUFError` that names what is wrong: a truncated file
(the tensor whose data runs past its end), a tensor type this gguf package does not know, a type
iterserve cannot dequantise. `QuantShard` is the raw, still-quantised form of a weight's rows that
the loader keeps for the platform's quantised kernels (model.gguf_sources, model/loader.py).
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("iterserve.loader")

INDEX_VERSION = 2
MAX_STORED_ARRAY = 256  # metadata arrays longer than this (vocabularies) keep only their length
GGUF_DEQUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                      "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")  # stored as plain numbers: no quantised twin needs their bytes
# control tokens that end a turn (llama.cpp's end-of-generation tokens, found by their text when the
# file names no eot_token_id): found once in the vocabulary and kept in the index
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|end_of_text|>")
CONTROL_TOKEN_TYPE = 3  # gguf.TokenType.CONTROL


class GGUFError(ValueError):
    """A GGUF file iterserve cannot load; the message names the file and the key or tensor."""


@dataclass
class QuantShard:
    """The raw rows of one GGUF tensor inside a (possibly fused) parameter of the decoder, for the
    platform's quantised kernels. `model.gguf_sources[module]` lists them in row order."""

    row_start: int  # first output row of the fused parameter this shard fills
    rows: int
    cols: int  # input features
    qtype: str  # GGMLQuantizationType name, e.g. "Q4_K", "Q6_K", "Q8_0", "F16", "F32"
    data: torch.Tensor  # uint8 [rows, bytes_per_row]: the file's blocks of these rows, as stored (a copy,
    # contiguous; or a view of the file's map, GGUFTensor.mapped)
    # n > 0: the rows are in the file's order, llama.cpp's Q/K permutation of n heads not undone (a view
    # of the map cannot be reordered); the consumer reorders its outputs (cpu_linear.output_order)
    permuted_heads: int = 0


def cache_dir() -> Path:
    return Path(os.environ.get("ITERSERVE_CACHE", Path.home() / ".cache" / "iterserve"))


def file_key(path: Path) -> str:
    """Changes whenever the file is replaced or rewritten."""
    st = path.stat()
    return hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


@dataclass
class TensorEntry:
    name: str
    qtype: str  # GGMLQuantizationType name
    shape: tuple[int, ...]  # torch order: (rows, cols)
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


@dataclass
class GGUFTensor:
    """One tensor's raw data: bytes (or typed values) as stored, shaped row by row."""

    name: str
    qtype: str
    shape: tuple[int, ...]
    data: np.ndarray
    # the same bytes as a uint8 tensor [rows, bytes a row] over one storage for the whole file map:
    # blocks kept as they are (the loader's mapped modules) share the file's pages, with each other
    # and with every process that maps the file, and cost no copy
    mapped: torch.Tensor | None = None


@dataclass
class GGUFIndex:
    fields: dict  # scalar and short array metadata values
    array_lengths: dict[str, int]  # long metadata arrays (token lists): length only
    tensors: list[TensorEntry]
    end_of_turn: dict[str, int] = field(default_factory=dict)  # END_OF_TURN_TOKENS found as control tokens

    def get(self, key: str, default=None):
        return self.fields.get(key, default)

    def tensor(self, name: str) -> TensorEntry | None:
        return next((t for t in self.tensors if t.name == name), None)

    def to_json(self) -> str:
        return json.dumps({"version": INDEX_VERSION, "fields": self.fields,
                           "array_lengths": self.array_lengths,
                           "tensors": [vars(t) for t in self.tensors], "end_of_turn": self.end_of_turn})

    @classmethod
    def from_json(cls, text: str) -> "GGUFIndex":
        d = json.loads(text)
        if d.get("version") != INDEX_VERSION:
            raise ValueError("stale index")
        tensors = [TensorEntry(**{**t, "shape": tuple(t["shape"])}) for t in d["tensors"]]
        return cls(d["fields"], d["array_lengths"], tensors, d["end_of_turn"])

    @classmethod
    def from_reader(cls, reader) -> "GGUFIndex":
        from gguf import GGUFValueType

        fields, lengths = {}, {}
        for key, f in reader.fields.items():
            if f.types and f.types[0] == GGUFValueType.ARRAY and len(f.data) > MAX_STORED_ARRAY:
                lengths[key] = len(f.data)
            else:
                fields[key] = f.contents()
        tensors = [TensorEntry(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)),
                               int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
        return cls(fields, lengths, tensors, _end_of_turn_tokens(reader))


def _end_of_turn_tokens(reader) -> dict[str, int]:
    """{text: id} of the END_OF_TURN_TOKENS the vocabulary has as control tokens (one pass over the
    raw token strings; their lengths filter most of them out before any bytes are compared)."""
    tokens, types = reader.fields.get("tokenizer.ggml.tokens"), reader.fields.get("tokenizer.ggml.token_type")
    if tokens is None:
        return {}
    wanted = {t.encode(): t for t in END_OF_TURN_TOKENS}
    sizes = {len(b) for b in wanted}
    found = {}
    for i, part in enumerate(tokens.data):
        raw = tokens.parts[part]
        if len(raw) in sizes and (text := wanted.get(raw.tobytes())) is not None:
            if types is None or int(types.parts[types.data[i]][0]) == CONTROL_TOKEN_TYPE:
                found[text] = i
    return found


def _checked_reader(path: Path):
    """gguf.GGUFReader over a plain array view of the file, and a tensor of a type unknown to gguf
    or whose data runs past the end of the file is refused by name before the reader slices it (it
    would fail on a reshape, naming nothing)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class Reader(GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            # a plain ndarray view of the map: every one of the reader's ~10 slices per token string
            # would otherwise pay for np.memmap's subclass hooks (3x slower on a 262k vocabulary)
            self._plain = np.asarray(value)

        def _build_tensors(self, start_offs, fields):
            for f in fields:
                _, name, _, dims, raw_type, offset = f.parts
                name = bytes(name).decode("utf-8", "replace")
                try:
                    qtype = GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise GGUFError(f"{path}: GGUF tensor {name!r} has quantisation type id {int(raw_type[0])}, "
                                    "which the gguf package does not know") from None
                block, size = GGML_QUANT_SIZES[qtype]
                end = int(start_offs + offset[0]) + int(np.prod(dims)) * size // block
                if end > len(self.data):
                    raise GGUFError(f"{path}: the file is truncated: GGUF tensor {name!r} ends at byte {end} "
                                    f"but the file has {len(self.data)} bytes")
            super()._build_tensors(start_offs, fields)

    return Reader(str(path))


def read_index(path: Path, use_cache: bool = True) -> GGUFIndex:
    """The file's metadata and tensor table: from the cache, or parsed once by GGUFReader."""
    cached = cache_dir() / "gguf" / f"{file_key(path)}.json"
    if use_cache and cached.is_file():
        try:
            return GGUFIndex.from_json(cached.read_text())
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring unreadable GGUF index %s", cached)
    try:
        reader = _checked_reader(path)
    except GGUFError:
        raise
    except (ValueError, IndexError, KeyError, UnicodeDecodeError) as e:
        raise GGUFError(f"{path}: not a readable GGUF file (truncated or not GGUF: {e})") from None
    index = GGUFIndex.from_reader(reader)
    del reader  # drops its memory map of the file
    if use_cache:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(index.to_json())
            tmp.replace(cached)
        except OSError:
            pass  # a read-only cache only costs time
    return index


def iter_tensors(path: Path, index: GGUFIndex) -> Iterator[GGUFTensor]:
    """Yields each tensor's raw data as a read-only view of one memory map of the file (map_file: as an
    ndarray, and as a uint8 tensor over the whole map's one storage). The map is released once the
    iteration ends and the caller has dropped the views. Once the caller asks
    for the next tensor, the pages of the one before leave this process (madvise DONTNEED: the file
    stays in the page cache, a later read of a kept view maps it again), so loading never holds the
    whole file mapped beside what it keeps of it: peak RSS is the kept copy plus one tensor (and a 2 MiB
    stretch at each tensor boundary, _release)."""
    mm = map_file(path, (min((t.offset for t in index.tensors), default=0),
                         max((t.offset + t.nbytes for t in index.tensors), default=0)))
    # a plain ndarray view: slices of an np.memmap are memmaps too, and the dequantisers' many
    # small slices would each pay for the subclass (about a third of the dequantisation time)
    data = np.frombuffer(mm, dtype=np.uint8)
    with warnings.catch_warnings():  # read-only by design: nothing writes to a weight's blocks
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        whole = torch.frombuffer(mm, dtype=torch.uint8)
    try:
        for t in index.tensors:
            rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
            raw = data[t.offset:t.offset + t.nbytes]
            mapped = whole[t.offset:t.offset + t.nbytes].view(rows, t.nbytes // rows)
            yield GGUFTensor(t.name, t.qtype, t.shape, raw.reshape(*t.shape[:-1], t.nbytes // rows), mapped)
            _release(mm, t.offset, t.nbytes)
    finally:
        del data, whole


LARGE_PAGE = 2 << 20  # x86-64's PMD page: what the kernel maps a 2 MiB page-cache folio with
LARGE_PAGES_ENV = "ITERSERVE_GGUF_LARGE_PAGES"  # "0": map the file as the page cache holds it, re-read nothing
CHECK_BYTES = 64 << 20  # map_file maps this much of the file at a time to count its large pages
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+; Python 3.11's mmap lacks the name
SMALL_TOLERATED = 0.02  # share of the tensors' 2 MiB stretches that may stay small before the file is read again


def map_file(path: Path, span: tuple[int, int] | None = None) -> mmap.mmap:
    """The file's read-only memory map, held in 2 MiB pages where the kernel and filesystem can.

    Why: a decode step streams every weight once, and with 4 KiB pages the hardware prefetcher stops
    at each page boundary and every page costs a TLB miss: the 65 projections of a 1B Q4_K_M ran
    10-12 % faster from a file the page cache held in 2 MiB folios than from the same bytes in 4 KiB
    ones (2-core Zen 3), and a whole one-row step 17-20 % faster (2-core AMX Xeon, with 58 % of the
    file small; docs/profile.md). The map asks for large pages (MADV_HUGEPAGE), so what it reads from
    the disk arrives in 2 MiB folios. A file the page cache already holds in small folios (written by a
    copy or a download, or read by another program), in whole or in part, stays small whatever the map
    asks. So map_file counts, over `span` (the tensors' bytes; default the whole file), the 2 MiB
    stretches the cache holds large (_large_share: each 64 MiB populated, counted, unmapped); where
    more than SMALL_TOLERATED are small, it drops all the file's cached pages (posix_fadvise DONTNEED:
    pages another process maps stay, and are shared) and reads them once from the disk, large. Later
    loads, and replicas, find the file large. ITERSERVE_GGUF_LARGE_PAGES=0 keeps the page cache as it is."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if os.environ.get(LARGE_PAGES_ENV, "1") != "0":
            _ask_for_large_pages(mm, f.fileno(), path, span or (0, len(mm)))
    return mm


def _ask_for_large_pages(mm: mmap.mmap, fd: int, path: Path, span: tuple[int, int]) -> None:
    """MADV_HUGEPAGE on the map, and the page cache re-read where it holds the span in small folios
    (map_file). Silent where the platform has none of it."""
    if len(mm) < 4 * LARGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(os, "posix_fadvise"):
        return
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages
        return
    view = np.frombuffer(mm, dtype=np.uint8)
    address = view.ctypes.data
    del view
    if address % LARGE_PAGE:
        return  # a 2 MiB entry maps a 2 MiB-aligned file offset at a 2 MiB-aligned address: none would fit
    # whole stretches only: the header's, read by a reader that asked for no large pages, stays small
    start = -(-span[0] // LARGE_PAGE) * LARGE_PAGE
    end = min(span[1], len(mm)) // LARGE_PAGE * LARGE_PAGE
    if end <= start:
        return
    share = _large_share(mm, address, start, end)
    if share is None or share >= 1 - SMALL_TOLERATED:
        return  # cached large, or just read from the disk so (or this kernel cannot populate a range)
    # first one stretch, dropped and read again: where it comes back small, this kernel or filesystem
    # gives no large folios, and reading the whole file again would only cost a start its time
    probe = (start + end) // 2 // LARGE_PAGE * LARGE_PAGE
    os.posix_fadvise(fd, probe, LARGE_PAGE, os.POSIX_FADV_DONTNEED)
    now = share
    if _large_share(mm, address, probe, probe + LARGE_PAGE):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        now = _large_share(mm, address, start, end) or 0.0
    if now < 1 - SMALL_TOLERATED:
        log.info("%s: %.0f %% of it mapped in 4 KiB pages (this kernel or filesystem gives it no 2 MiB pages, "
                 "or another process holds them small)", path.name, 100 * (1 - now))
        return
    log.info("%s: the page cache held %.0f %% of it in 4 KiB pages; read it once from the disk into 2 MiB "
             "pages (decode reads the weights faster; %s=0 keeps the cache as it is)",
             path.name, 100 * (1 - share), LARGE_PAGES_ENV)


def _large_share(mm: mmap.mmap, address: int, start: int, end: int) -> float | None:
    """The share of [start, end) (2 MiB-aligned) the page cache holds in 2 MiB folios: each CHECK_BYTES
    populated (MADV_POPULATE_READ, which reads what is not cached through the map's large-page advice),
    counted (smaps' FilePmdMapped) and unmapped again, so the check holds at most CHECK_BYTES of the
    file in this process. None where the kernel cannot populate a range (before Linux 5.14)."""
    large = 0
    for off in range(start, end, CHECK_BYTES):
        n = min(CHECK_BYTES, end - off)
        try:
            mm.madvise(MADV_POPULATE_READ, off, n)
        except OSError:
            return None
        large += large_mapped_bytes(address)
        mm.madvise(mmap.MADV_DONTNEED, off, n)
    return large / (end - start)


def large_mapped_bytes(address: int | None = None, path: Path | None = None,
                       smaps: Path = Path("/proc/self/smaps")) -> int:
    """Bytes this process maps with 2 MiB entries (smaps' FilePmdMapped) of the file mapping that
    contains `address`, or of every mapping of the file `path`; 0 where /proc is not there."""
    try:
        text = smaps.read_text()
    except OSError:
        return 0
    name = str(path.resolve()) if path is not None else None
    inside, total = False, 0
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if not parts[0].endswith(":"):  # a mapping's header: start-end perms offset dev inode [path]
            start, _, end = parts[0].partition("-")
            if name is not None:
                inside = len(parts) == 6 and parts[5] == name
            else:
                inside = int(start, 16) <= address < int(end, 16)
        elif inside and parts[0] == "FilePmdMapped:":
            total += int(parts[1]) * 1024
    return total


def _release(mm: mmap.mmap, offset: int, nbytes: int) -> None:
    """Drops this process's pages of the 2 MiB stretches of the map wholly inside [offset, offset +
    nbytes) (not on every platform). A stretch the tensor shares with a neighbour stays: dropping part
    of a 2 MiB entry splits it into 4 KiB ones for good (map_file), and the model reads it again anyway."""
    if not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = -(-offset // LARGE_PAGE) * LARGE_PAGE
    end = len(mm) if offset + nbytes >= len(mm) else (offset + nbytes) // LARGE_PAGE * LARGE_PAGE
    if end > start:
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undoes llama.cpp's convert-time permutation of Q/K rows (interleaved -> rotate-half). A row
    permutation: it applies as well to a tensor of raw quantised rows (blocks run along a row)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(t: GGUFTensor) -> torch.Tensor:
    """One GGUF tensor to a float32 torch tensor of shape t.shape, via gguf's dequantisers."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if t.qtype not in GGUF_DEQUANT_TYPES:
        raise GGUFError(f"GGUF tensor {t.name}: quantisation {t.qtype} is not supported "
                        f"(supported: {', '.join(GGUF_DEQUANT_TYPES)})")
    arr = dequantize(t.data, GGMLQuantizationType[t.qtype]).reshape(t.shape)
    if arr.dtype != np.float32 or not arr.flags.writeable or np.may_share_memory(arr, t.data):
        arr = arr.astype(np.float32)  # F32 comes back as a view of the read-only map: copy it
    return torch.from_numpy(arr)

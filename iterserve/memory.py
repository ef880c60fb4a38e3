"""Memory, planned before the model loads and reported once it has: weights, KV cache, workspace.

A model that cannot fit is refused before a byte of it is read (`MemoryPlan.check`), with the
numbers, instead of being killed half-way by the kernel's OOM killer. After loading, the engine
measures what is really there (`MemoryReport`): the weights as the tensors the model holds,
whatever form the loader and the platform left them in (dense, packed for a GEMM, quantised twins,
a tied head, a file's memory map), each storage counted once; the KV cache as its allocated
tensors; the workspace as an estimate (activations are not kept, so there is nothing to measure).
The start-up log, /v1/scheduler and /metrics all show this one report.
"""
from __future__ import annotations

import bisect
import ctypes
import functools
import mmap
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from iterserve.config import EngineConfig, ModelConfig
from iterserve.model.gguf_file import LARGE_PAGE

GIB = 2**30
# per token of a step, the activations alive at once, in hidden-size units besides the MLP's:
# residual, normed input, attention output, and slack for the projections' outputs
_HIDDEN_ACTIVATIONS = 4
_MLP_ACTIVATIONS = 3  # gate and up (fused), and their product


class InsufficientMemory(ValueError):
    """The model, its KV cache and workspace do not fit in the memory available. A ValueError, as
    every start-up refusal is: `iterserve serve` prints the message and exits 2, no traceback."""


def gib(n: int | float) -> str:
    return f"{n / GIB:.2f}"


@dataclass
class MemoryPlan:
    """What a model will need, estimated from its checkpoint and the configuration before loading,
    against what the machine has (None: unknown, as on a non-Linux host: nothing is refused)."""

    weights: int
    kv_cache: int
    workspace: int
    available: int | None

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.workspace

    @property
    def fits(self) -> bool:
        return self.available is None or self.total <= self.available

    def refusal(self) -> str:
        """The message that says what does not fit and what to change."""
        return (f"model needs about {self.total / GIB:.1f} GiB (weights {self.weights / GIB:.1f}, KV cache "
                f"{self.kv_cache / GIB:.1f}, workspace {self.workspace / GIB:.1f}) but "
                f"{(self.available or 0) / GIB:.1f} GiB is available: lower --kv-cache-memory (or "
                "--num-kv-blocks), --max-num-batched-tokens or --max-num-seqs, use a smaller or more quantised "
                "model or --dtype bfloat16, or pass --skip-memory-check if you know better")

    def check(self) -> None:
        """Raises InsufficientMemory when the plan does not fit."""
        if not self.fits:
            raise InsufficientMemory(self.refusal())


@dataclass
class MemoryReport:
    """What the loaded engine holds, in bytes: weights split into resident (anonymous memory) and
    mapped (pages of a file's memory map, which the kernel can drop and read again), the KV cache's
    tensors, and the workspace estimate; `available` as measured after loading (None: unknown)."""

    weights_resident: int
    weights_mapped: int
    kv_cache: int
    num_kv_blocks: int
    block_size: int
    workspace_estimate: int
    available: int | None
    layers_per_block: int = 0  # a block holds one KV cache group's layers (core/kv_groups.py); 0: unknown

    def to_dict(self) -> dict:
        return asdict(self)

    def log_line(self) -> str:
        avail = "available memory unknown" if self.available is None else f"{gib(self.available)} GiB available"
        return (f"memory: weights {gib(self.weights_resident)} GiB resident + {gib(self.weights_mapped)} GiB mapped, "
                f"KV cache {gib(self.kv_cache)} GiB ({self.num_kv_blocks} blocks x {self.block_size} tokens"
                f"{f' x {self.layers_per_block} layers' if self.layers_per_block else ''}), "
                f"workspace ~{gib(self.workspace_estimate)} GiB (estimate); {avail}")


# ---- weights, measured -----------------------------------------------------------------------------
def model_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor the model keeps: parameters, buffers, tensors held as plain module attributes
    (a platform's packed GEMM weights), and the loader's raw GGUF blocks not yet taken by a twin."""
    for module in model.modules():
        yield from module.parameters(recurse=False)
        yield from module.buffers(recurse=False)
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                yield value
    for shards in (getattr(model, "gguf_sources", None) or {}).values():
        for shard in shards:
            if isinstance(shard.data, torch.Tensor):  # (a test's shards may hold numpy arrays)
                yield shard.data


def _file_mappings(maps: Path = Path("/proc/self/maps"), read_only: bool = False) -> list[tuple[int, int]]:
    """Sorted (start, end) address ranges of this process's mappings of regular files (with
    `read_only`, only those it cannot write: a GGUF's map, code); empty where /proc is not there
    (every storage then counts as resident)."""
    ranges = []
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split(maxsplit=5)
        path = parts[5] if len(parts) == 6 else ""
        if not path.startswith("/") or path.startswith("/dev/") or path.endswith("(deleted)"):
            continue  # anonymous, [heap], shared memory, or a file gone from the disk
        if read_only and "w" in parts[1]:
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        ranges.append((start, end))
    return sorted(ranges)


def release_mapped_pages(tensors: Iterable[torch.Tensor], maps: Path = Path("/proc/self/maps")) -> int:
    """Unmaps from this process the whole pages of `tensors` that lie in a read-only file mapping
    (madvise MADV_DONTNEED), and returns their bytes; tensors anywhere else are left alone (on memory
    of its own DONTNEED would zero it). For a GGUF's blocks that the platform has copied into a
    kernel's layout (the 32-input types, repacked four blocks to a group): the file's copy is never
    read again, yet each page the repacking read stayed in the process's RSS, a second copy of those
    weights (Gemma 3 270M: 0.22 GiB). The pages stay in the page cache, shared with any replica; a
    later read (an embedding row of a tied head's blocks) maps the page it touches again."""
    tensors = [t for t in tensors if t.device.type == "cpu" and t.numel()]
    if not tensors or _libc("madvise") is None or not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    ranges = _file_mappings(maps, read_only=True)
    return sum(length for a, length in (_whole_pages(t, ranges) for t in tensors) if length and unmap_pages(a, length))


def _whole_pages(t: torch.Tensor, ranges: list[tuple[int, int]]) -> tuple[int, int]:
    """(address, bytes) of the whole pages of t's bytes where they lie in one of `ranges`; (0, 0) if not."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    if t.device.type != "cpu" or not any(a <= start and end <= b for a, b in ranges):
        return 0, 0
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    return (first, last - first) if last > first else (0, 0)


def file_mapped_pages(t: torch.Tensor, maps: Path = Path("/proc/self/maps")) -> tuple[int, int] | None:
    """(address, bytes) of the whole pages of t's bytes, where they lie in a read-only file mapping
    (a GGUF's map) and the C library has madvise; else None. Read once: unmap_pages takes it."""
    if _libc("madvise") is None or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    address, length = _whole_pages(t, _file_mappings(maps, read_only=True))
    return (address, length) if length else None


def unmap_pages(address: int, length: int) -> bool:
    """madvise(MADV_DONTNEED) over [address, address + length), which must be whole pages of a
    read-only file mapping (file_mapped_pages): the process stops mapping them (its RSS drops), the
    page cache keeps them, and a later read maps them again. True on success."""
    return _libc("madvise")(ctypes.c_void_p(address), ctypes.c_size_t(length), mmap.MADV_DONTNEED) == 0


def empty_in_large_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose whole 2 MiB pages are asked for as transparent huge pages
    (MADV_HUGEPAGE) before their first touch. For what a step streams from memory: in 4 KiB pages
    each 4 KiB is a TLB entry and a page walk, long under a VM's nested paging, and the hardware
    prefetchers stop at each page's end. On the 2-core AMX Xeon (2026-12-06) a 2-thread sum read 33.7
    GB/s from 2 MiB pages against 23.6 from 4 KiB ones. Where the host gives no huge pages (THP off)
    the tensor is the same, in small pages."""
    t = torch.empty(shape, dtype=dtype)
    madvise = _libc("madvise")
    if madvise is not None and hasattr(mmap, "MADV_HUGEPAGE"):
        start = t.data_ptr()
        first = -(-start // LARGE_PAGE) * LARGE_PAGE
        whole = (start + t.numel() * t.element_size() - first) // LARGE_PAGE * LARGE_PAGE
        if whole > 0:
            madvise(ctypes.c_void_p(first), ctypes.c_size_t(whole), mmap.MADV_HUGEPAGE)
    return t


def in_large_pages(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous copy of `t` (converted to `dtype` where given) in 2 MiB pages
    (empty_in_large_pages): for a layout the model keeps and reads every step."""
    return empty_in_large_pages(tuple(t.shape), dtype or t.dtype).copy_(t)


def zeros_in_large_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """empty_in_large_pages, zeroed. For the KV cache: a decode step reads each sequence's blocks
    scattered over the layer's cache. The 1B's 16-row step on the 2-core AMX Xeon spent 6.0 instead
    of 7.0-7.1 ms in decode attention at 128 tokens of context, 15.0-15.4 instead of 17.4-19.3 at 384
    (docs/profile.md). The bytes are resident either way, as torch.zeros' are."""
    return empty_in_large_pages(shape, dtype).zero_()


@functools.cache
def _libc(name: str):
    """The C library's function `name` (ctypes), or None where it has none (malloc_trim is glibc's:
    musl and macOS lack it)."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


def weight_bytes(tensors: Iterable[torch.Tensor], maps: Path = Path("/proc/self/maps")) -> tuple[int, int]:
    """(resident, mapped) bytes of the storages behind `tensors`, each storage once: a tied head
    and its embedding, a twin that views its weight, count one. Opaque tensors (oneDNN's packed
    weights) have no storage to share and count at their size; meta tensors hold nothing."""
    storages: dict[object, tuple[int, int]] = {}  # key -> (address, bytes)
    for t in tensors:
        if t.device.type == "meta":
            continue
        try:
            s = t.untyped_storage()
            storages[(t.device, s.data_ptr())] = (s.data_ptr() if t.device.type == "cpu" else 0, s.nbytes())
        except (RuntimeError, NotImplementedError):  # "Cannot access storage of OpaqueTensorImpl"
            storages[("opaque", id(t))] = (0, t.numel() * t.element_size())
    ranges = _file_mappings(maps) if storages else []
    starts = [r[0] for r in ranges]
    resident = mapped = 0
    for address, nbytes in storages.values():
        i = bisect.bisect_right(starts, address) - 1
        if address and i >= 0 and address < ranges[i][1]:
            mapped += nbytes
        else:
            resident += nbytes
    return resident, mapped


def kv_cache_bytes(kv_caches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Bytes of the KV cache's allocated tensors (keys and values of every layer), each tensor once:
    with KV cache groups, layer j of every group shares tensor pair j (core/kv_groups.py)."""
    seen: dict[int, int] = {}
    for k, v in kv_caches:
        for t in (k, v):
            seen[id(t)] = t.nbytes
    return sum(seen.values())


# ---- workspace, estimated --------------------------------------------------------------------------
def workspace_estimate(config: EngineConfig, mcfg: ModelConfig, dtype: torch.dtype) -> int:
    """Per-step buffers, estimated: the activations of a step at the token budget (hidden states,
    Q/K/V, the MLP's intermediate) in the model's dtype, and float32 logits for each sequence a step
    can sample. An estimate: the allocator reuses activations and attention's scratch is not counted."""
    elem = torch.empty((), dtype=dtype).element_size()
    tokens = config.max_num_batched_tokens
    qkv = (mcfg.num_heads + 2 * mcfg.num_kv_heads) * mcfg.head_dim
    per_token = _HIDDEN_ACTIVATIONS * mcfg.hidden_size + qkv + _MLP_ACTIVATIONS * mcfg.intermediate_size
    return tokens * per_token * elem + config.max_seqs_per_step * mcfg.vocab_size * 4


# ---- available memory ------------------------------------------------------------------------------
def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2's "max": no limit


def _cgroup_room(proc: Path, cgroup: Path) -> int | None:
    """Bytes this process's cgroup may still allocate (its limit minus its usage), or None when no
    limit is set. cgroup v2 (memory.max, memory.current of the process's own group, or of the root
    of a container's namespace), else v1 (memory.limit_in_bytes, memory.usage_in_bytes)."""
    candidates = []
    try:
        for line in (proc / "self" / "cgroup").read_text().splitlines():
            hierarchy, controllers, path = line.split(":", 2)
            if hierarchy == "0" and controllers == "":
                candidates.append((cgroup / path.lstrip("/"), "memory.max", "memory.current"))
            elif "memory" in controllers.split(","):
                candidates.append((cgroup / "memory" / path.lstrip("/"), "memory.limit_in_bytes",
                                   "memory.usage_in_bytes"))
    except (OSError, ValueError):
        pass
    candidates += [(cgroup, "memory.max", "memory.current"),
                   (cgroup / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes")]
    for folder, limit_name, usage_name in candidates:
        limit, usage = _read_int(folder / limit_name), _read_int(folder / usage_name)
        if limit is not None and usage is not None and limit < 2**60:  # v1's "no limit" is a huge number
            return max(0, limit - usage)
    return None


def available_memory(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes a new allocation can have without swapping or the OOM killer: MemAvailable from
    /proc/meminfo, capped by the cgroup's room where a limit is set. None off Linux (no check)."""
    if not sys.platform.startswith("linux") and proc == Path("/proc"):
        return None
    try:
        meminfo = (proc / "meminfo").read_text()
    except OSError:
        return None
    avail = next((int(line.split()[1]) * 1024 for line in meminfo.splitlines()
                  if line.startswith("MemAvailable:")), None)
    room = _cgroup_room(proc, cgroup)
    if avail is None or room is None:
        return avail if room is None else room
    return min(avail, room)


def skip_reason(device: torch.device) -> str | None:
    """Why the host-memory check does not apply to this device, or None when it does: a CUDA
    device holds weights and KV blocks in its own memory, which its platform sizes itself."""
    return None if device.type == "cpu" else f"weights and KV cache live on {device}, not in host memory"


# ---- freed memory, handed back -------------------------------------------------------------------
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
# The thresholds while steps run, once set (setting one stops glibc moving both): the ceilings its
# moving ones reach, 32 MiB for the size malloc maps on its own and twice that for the trim threshold.
# A thread's arena keeps free memory up to STEP_TRIM_THRESHOLD at its top between trims.
STEP_MMAP_THRESHOLD = 32 << 20
STEP_TRIM_THRESHOLD = 64 << 20
TOP_TRIM_CHUNK = 96 << 10  # freeing a chunk of >= 64 KiB (and < 128 KiB: not mmapped) trims its arena's top


def release_free_heap() -> bool:
    """Hands the C heap's free pages back to the OS (glibc's malloc_trim, then the calling thread's
    arena top: _trim_this_threads_arena_top); False where the C library has no such call. A prompt
    chunk's activations are freed after its step, but glibc keeps most of what it freed in its
    arenas, resident: a served 1B held ~100 MiB more after a few prompts than before them
    (docs/profile.md). The server calls this once its engine has been idle a while
    (async_engine.IDLE_RELEASE_S): the next prompt re-faults the pages, which between steps or
    between back-to-back requests would cost prefill time."""
    trim = _libc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    _trim_this_threads_arena_top()
    return True


def _trim_this_threads_arena_top() -> None:
    """glibc's malloc_trim returns the free pages inside every arena but shortens only the main heap's
    top; an arena's top is shortened when a chunk of 64 KiB or more is freed in it while the top
    exceeds the trim threshold. The engine steps in a thread of its own, whose arena is not the main
    heap: so, in that thread, the threshold to 0, one such chunk allocated and freed, then the
    step thresholds (their moving values' ceilings, above). In the served 1B, idle after a few
    prompts, malloc_trim gave back 5 MiB and this 20 MiB more (2-core AMX Xeon, 2026-12-05;
    docs/profile.md, "Memory of a served model"); how much depends on where the freed activations
    lie. Only at idle: trimming as steps run re-faults the next step's activations (a 16-concurrent
    load ran ~5 % slower with an 8 MiB threshold throughout)."""
    mallopt, malloc, free = _libc("mallopt"), _libc("malloc"), _libc("free")
    if mallopt is None or malloc is None or free is None:
        return
    malloc.restype, free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    mallopt(_M_TRIM_THRESHOLD, 0)
    free(malloc(TOP_TRIM_CHUNK))
    mallopt(_M_TRIM_THRESHOLD, STEP_TRIM_THRESHOLD)
    mallopt(_M_MMAP_THRESHOLD, STEP_MMAP_THRESHOLD)

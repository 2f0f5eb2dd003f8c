"""The copy engine: moves KV blocks between an engine's tensors and hostkv's canonical pages.

A page's bytes have one layout (:class:`hostkv.KVLayout`): ``[layer][K, V][token][kv_head]
[head_dim]``, or ``[layer][token][latent]`` for MLA. Engines lay their blocks out in many
ways: vLLM's logical ``[blocks, heads, tokens, K|V dims]`` in any physical order, the older
flash-attention ``[2, blocks, tokens, heads, dim]``, FlashInfer's NHD and HND, one tensor for
every layer. A :class:`BlockLayout` names an engine tensor's axes once, from what the engine
declares; :class:`CopyEngine` turns that into strided views of both sides and copies block
``b`` of every layer to page ``p`` (a save) or back (a load), straight between the two
buffers: no intermediate tensor, no Python per block; on a CPU, one compiled call per step
for every layer (``hostkv._blockcopy``), after mapping the step's pages into this process
in one system call per run of pages where it had not touched them yet.

With tensor parallelism a rank holds a slice of the KV heads; its engine moves only that
slice of each page (``heads``), and where heads are replicated across ranks only one of
them writes (``writes``).

Needs torch; never an engine. Integrations (``hostkv.vllm``, the example engine loop) call it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from hostkv._blockcopy import check_blocks, copy_layers, populate_pages
from hostkv._copyplan import CopyPlan, CopyStats
from hostkv._validate import is_bool
from hostkv.config import KVLayout
from hostkv.transfers import CopyThread, Transfer

if TYPE_CHECKING:
    from hostkv.cuda_copy import CudaCopier, CudaDevice, HostRegistration

__all__ = ["BlockLayout", "CopyEngine", "CopyPlan", "CopyStats", "head_slice_for_rank"]

# The canonical order of one block's axes, after the block axis.
_CANONICAL = ("kv", "token", "head", "dim")
_NAMES = ("layer", "block") + _CANONICAL
_TOKEN = re.compile(r"\(|\)|[a-z_]+")


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """The axes of an engine's KV tensor, by name, outermost first.

    Names: ``block`` (required), ``token`` (the tokens of a block, required), ``dim`` (a
    head's elements, or the MLA latent, required), ``kv`` (K and V, size 2; absent for MLA),
    ``head`` (KV heads; absent means one), ``layer`` (one tensor for every layer). A
    parenthesised group is one tensor axis holding its names row-major: vLLM's
    ``(kv dim)`` is an axis of ``2 * head_dim`` elements, K's then V's. Strides are read from
    the tensor itself, so one BlockLayout serves every physical order of the same logical
    shape.

    Attributes:
        axes: The description, e.g. ``"block head token (kv dim)"``.
        name: Who declares it (in error messages).
    """

    axes: str
    name: str = ""

    def groups(self) -> List[Tuple[str, ...]]:
        """The tensor's axes, each the tuple of the names it holds.

        Raises:
            ValueError: a malformed description, an unknown or repeated name, or a missing
                ``block``, ``token`` or ``dim``.
        """
        groups: List[Tuple[str, ...]] = []
        current: Optional[List[str]] = None
        for word in _TOKEN.findall(self.axes):
            if word == "(":
                if current is not None:
                    raise ValueError(f"block layout {self.axes!r}: nested parentheses")
                current = []
            elif word == ")":
                if not current:
                    raise ValueError(f"block layout {self.axes!r}: an empty or unopened group")
                groups.append(tuple(current))
                current = None
            elif current is not None:
                current.append(word)
            else:
                groups.append((word,))
        if current is not None:
            raise ValueError(f"block layout {self.axes!r}: an unclosed group")
        names = [name for group in groups for name in group]
        unknown = sorted(set(names) - set(_NAMES))
        if unknown:
            raise ValueError(f"block layout {self.axes!r}: unknown axes {unknown}; known: "
                             f"{list(_NAMES)}")
        if len(names) != len(set(names)):
            raise ValueError(f"block layout {self.axes!r}: an axis named twice")
        missing = [name for name in ("block", "token", "dim") if name not in names]
        if missing:
            raise ValueError(f"block layout {self.axes!r}: no {' or '.join(missing)} axis")
        return groups


# Layouts engines declare. vLLM (0.32 and later) hands every attention backend's per-layer
# cache as the logical [blocks, heads, tokens, content] view of its KVCacheLayout, content
# being K's head_dim elements then V's (or one latent vector for MLA); the physical order
# lives in the view's strides.
VLLM = BlockLayout("block head token (kv dim)", "vLLM [blocks, kv_heads, block_size, 2*head_size]")
VLLM_MLA = BlockLayout("block head token dim", "vLLM MLA [blocks, 1, block_size, latent]")
FLASH_ATTN = BlockLayout("kv block token head dim", "flash-attention [2, blocks, tokens, heads, dim]")
FLASHINFER_NHD = BlockLayout("block kv token head dim", "FlashInfer NHD [blocks, 2, tokens, heads, dim]")
FLASHINFER_HND = BlockLayout("block kv head token dim", "FlashInfer HND [blocks, 2, heads, tokens, dim]")
CROSS_LAYER = BlockLayout("block layer kv token head dim",
                          "cross-layer [blocks, layers, 2, tokens, heads, dim]")


def head_slice_for_rank(total_heads: int, rank: int, world: int) -> Tuple[int, int, bool]:
    """The KV heads a tensor-parallel rank holds, and whether it writes them.

    Heads are split evenly across ranks; with fewer heads than ranks each head is
    replicated on ``world // total_heads`` consecutive ranks, and the first of them writes.

    Returns:
        (first head, one past the last, writes).

    Raises:
        ValueError: heads and ranks that do not divide one another.
    """
    if world <= 0 or not 0 <= rank < world:
        raise ValueError(f"tensor-parallel rank {rank} of {world}")
    if total_heads >= world:
        if total_heads % world:
            raise ValueError(f"{total_heads} KV heads do not split over {world} ranks")
        per_rank = total_heads // world
        return rank * per_rank, (rank + 1) * per_rank, True
    if world % total_heads:
        raise ValueError(f"{total_heads} KV heads do not replicate evenly over {world} ranks")
    replicas = world // total_heads
    head = rank // replicas
    return head, head + 1, rank % replicas == 0


def _canonical_view(tensor: torch.Tensor, block_layout: BlockLayout,
                    sizes: Dict[str, int]) -> torch.Tensor:
    """The tensor viewed (no copy) as [layer?, block, kv, token, head, dim]."""
    groups = block_layout.groups()
    described = block_layout.name or block_layout.axes
    if tensor.dim() != len(groups):
        raise ValueError(f"hostkv: {described}: a KV tensor of shape {tuple(tensor.shape)} "
                         f"has {tensor.dim()} axes, the layout {len(groups)}")
    view = tensor
    names: List[str] = []
    for axis in reversed(range(len(groups))):
        group = groups[axis]
        if len(group) > 1:
            inner = [sizes[name] for name in group]
            if int(np.prod(inner)) != view.shape[axis]:
                raise ValueError(
                    f"hostkv: {described}: axis {axis} of shape {tuple(tensor.shape)} holds "
                    f"{view.shape[axis]} elements, not {' x '.join(map(str, inner))} "
                    f"({' '.join(group)})")
            view = view.unflatten(axis, inner)
        names[0:0] = list(group)
    for name, size in zip(names, view.shape):
        if name in sizes and size != sizes[name]:
            raise ValueError(f"hostkv: {described}: KV tensor of shape {tuple(tensor.shape)} "
                             f"has {size} along {name!r}, hostkv expects {sizes[name]}")
    for name in _CANONICAL:
        if name not in names:
            if sizes[name] != 1:
                raise ValueError(f"hostkv: {described}: no {name!r} axis, but the pages hold "
                                 f"{sizes[name]}")
            view = view.unsqueeze(-1)
            names.append(name)
    order = [names.index(name) for name in ("layer", "block") + _CANONICAL if name in names]
    return view.permute(order)


def _index_array(values: Sequence[int], what: str) -> np.ndarray:
    """Block or page indices as a 1-D integer array, not yet range-checked.

    Python and numpy integers, in a sequence or a numpy (or CPU torch) integer array; one
    integer is one index. numpy would take ``1.9`` for block 1 and ``True`` for block 1
    without a word, so floats and bools, numpy's included, are refused, as hostkv refuses
    them everywhere (``hostkv._validate``).

    Raises:
        ValueError: anything else, naming the values.
    """
    if type(values) is np.ndarray and values.ndim == 1 and values.dtype.kind in "iu":
        return values                    # the common case, first and cheap
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise ValueError(f"hostkv: {what} must be integers, got {type(values).__name__}: "
                         f"{exc}") from None
    if arr.size == 0 and arr.ndim == 1:
        return np.empty(0, dtype=np.int64)   # numpy makes [] float64
    if arr.dtype.kind not in "iu":
        raise ValueError(f"hostkv: {what} must be integers, got {arr.dtype} values "
                         f"{_head(arr)}")
    if arr.ndim == 0:
        return arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(f"hostkv: {what} must be a 1-D sequence of integers, got shape "
                         f"{arr.shape}: {_head(arr)}")
    if not isinstance(values, np.ndarray):
        # numpy turns True among integers into 1: look at the elements that became 0 or 1.
        for i in np.flatnonzero(arr <= 1).tolist():
            element = values[i]
            if is_bool(element):
                raise ValueError(f"hostkv: {what}[{i}] is {element!r}: {what} must be "
                                 "integers, not bools")
    return arr


def _head(arr: np.ndarray) -> str:
    """An array's first values, for messages."""
    values = arr.reshape(-1)[:16].tolist()
    return f"{values}{' ...' if arr.size > 16 else ''}"


def _pool_bytes(pool: torch.Tensor, layout: KVLayout, page_size: int) -> torch.Tensor:
    """The pool's bytes as a flat uint8 tensor over the same memory, once the pool is seen
    to hold whole pages of ``layout`` and ``page_size``.

    Raises:
        ValueError: not a tensor, not a CPU tensor, not contiguous (reshape would copy it:
            the copies would fill the copy), or pages of another size (a pool whose first
            axis is not its pages, or a segment of another page size or layout: its bytes
            would be read as pages of this one).
    """
    if not isinstance(pool, torch.Tensor):
        raise ValueError(f"hostkv: the pool must be a torch.Tensor, got {type(pool).__name__}")
    if pool.device.type != "cpu":
        raise ValueError(f"hostkv: the pool is host memory, got a tensor on {pool.device}")
    if not pool.is_contiguous():
        raise ValueError(f"hostkv: the pool must be contiguous, got shape {tuple(pool.shape)} "
                         f"stride {tuple(pool.stride())}")
    page_bytes = layout.page_bytes(page_size)
    nbytes = pool.numel() * pool.element_size()
    # A pool of more than one axis has one page per index of its first (pages_tensor(),
    # pages_array()); a flat pool, only its size to go by.
    per_page = nbytes // pool.shape[0] if pool.dim() > 1 and pool.shape[0] else page_bytes
    if per_page != page_bytes or nbytes % page_bytes or nbytes == 0:
        raise ValueError(
            f"hostkv: a pool of shape {tuple(pool.shape)} {pool.dtype} ({nbytes} bytes"
            f"{f', {per_page} a page' if pool.dim() > 1 else ''}) does not hold pages of "
            f"{page_size} tokens x {layout.token_bytes} bytes ({page_bytes} bytes a page)")
    flat = pool.reshape(-1)
    return flat if pool.dtype == torch.uint8 else flat.view(torch.uint8)


def _check_layers_agree(views: Sequence[torch.Tensor]) -> None:
    """Every layer's view has the same number of blocks and lives on the same device: the
    compiled loop checks the indices against one count, and reads every layer's memory
    from one side.

    Raises:
        ValueError: naming the layers that differ from layer 0, and how.
    """
    blocks = [int(view.shape[0]) for view in views]
    odd = [(layer, n) for layer, n in enumerate(blocks) if n != blocks[0]]
    if odd:
        listed = ", ".join(f"layer {layer} has {n}" for layer, n in odd[:8])
        raise ValueError(f"hostkv: the KV tensors' layers hold different numbers of blocks: "
                         f"layer 0 has {blocks[0]}, {listed}"
                         f"{' ...' if len(odd) > 8 else ''}")
    devices = [(layer, view.device) for layer, view in enumerate(views)
               if view.device != views[0].device]
    if devices:
        layer, device = devices[0]
        raise ValueError(f"hostkv: the KV tensors' layers live on different devices: layer 0 "
                         f"on {views[0].device}, layer {layer} on {device}")


@dataclasses.dataclass
class _LayerGroup:
    """Layers one compiled call copies: the same plan and engine block stride."""

    plan: CopyPlan
    engine_block_stride: int
    engine_layers: np.ndarray           # uint64: each layer's block 0, engine side
    pool_layers: np.ndarray             # uint64: each layer's page 0, pool side


@dataclasses.dataclass
class _CpuCopies:
    """A CPU engine's copies, as CopyEngine._cpu_setup worked them out."""

    groups: List[_LayerGroup]
    num_pages: int
    page_stride: int                    # bytes from one page to the next
    pool_base: int                      # page 0's first byte in this process
    mapped: Optional[np.ndarray]        # uint8 per page: populated for a save in this
                                        # process (None: never populate, let the copies
                                        # fault them in)


class CopyEngine:
    """Copies between an engine's KV blocks (every layer) and hostkv's canonical pages.

    Build one per process once the engine's KV tensors exist; then every step calls
    :meth:`save` (blocks -> pages, after the forward wrote them) and :meth:`load` (pages ->
    blocks, before the forward reads them) with that step's block and page indices.

    Args:
        pool: The page pool as a tensor (``HostKVCache.pages_tensor()``, any shape and
            dtype: only its bytes are used); it must outlive the engine.
        layout: The pages' KVLayout (the segment's).
        page_size: Tokens per page, equal to the engine's block size.
        kv_tensors: The engine's KV tensors in layer order (one per layer), or a single
            tensor whose BlockLayout has a ``layer`` axis.
        block_layout: How those tensors lay blocks out.
        heads: (first, stop) of the canonical KV heads these tensors hold (a
            tensor-parallel rank's slice); None: all of them.
        writes: False for a rank whose heads another rank also holds and writes: its
            saves move nothing.
        asynchronous: On a CPU, run :meth:`submit_save`'s copies on a copy thread
            instead of inline (on a GPU they always run on a side stream).
        staging_bytes: On a GPU, each direction's staging buffer, allocated now and never
            grown (``hostkv.cuda_copy.DEFAULT_STAGING_BYTES`` unless told; at least one
            page of this rank). Larger transfers run through it in pieces.
        layers: (start, stop, step) of the page's layers these tensors are, as a slice
            takes them (an engine whose layers come in groups with block tables of their
            own copies each group's layers with an engine of its own); None: every layer.
        register: On a GPU, register the pool with CUDA (False for every engine of a
            pool but one: a range is registered once).

    Raises:
        ValueError: a tensor whose shape, dtype or device does not fit the layout (the
            message names the layout, the shape and the axis); layers of different block
            counts or devices (naming them); a pool that does not hold whole pages of this
            layout and page size, or is not a contiguous CPU tensor.
    """

    _cpu: Optional[_CpuCopies] = None   # the CPU path's setup, made by its first copy

    def __init__(self, pool: torch.Tensor, layout: KVLayout, page_size: int,
                 kv_tensors: Sequence[torch.Tensor] | torch.Tensor, block_layout: BlockLayout,
                 *, heads: Optional[Tuple[int, int]] = None, writes: bool = True,
                 asynchronous: bool = False, staging_bytes: Optional[int] = None,
                 layers: Optional[Tuple[int, int, int]] = None, register: bool = True) -> None:
        self.layout = layout
        self.page_size = page_size
        self.writes = writes
        first, stop = heads if heads is not None else (0, layout.num_kv_heads)
        if not 0 <= first < stop <= layout.num_kv_heads:
            raise ValueError(f"hostkv: KV heads [{first}, {stop}) outside the pages' "
                             f"{layout.num_kv_heads}")
        self.heads = (first, stop)
        dtype = getattr(torch, layout.dtype)
        pool_bytes = _pool_bytes(pool, layout, page_size)
        self.pool_bytes = pool_bytes
        num_pages = pool_bytes.numel() // layout.page_bytes(page_size)
        # [pages, layers, kv, tokens, heads, dim] with this rank's heads.
        pool6 = pool_bytes.view(dtype).view(num_pages, layout.num_layers, layout.kv_planes,
                                            page_size, layout.num_kv_heads, layout.head_dim)
        if layers is not None:
            if len(range(*layers)) == 0 or not (0 <= layers[0] and layers[1] <= layout.num_layers
                                                and layers[2] > 0):
                raise ValueError(f"hostkv: layers {layers} of pages of {layout.num_layers}")
            pool6 = pool6[:, layers[0]:layers[1]:layers[2]]
        num_layers = pool6.shape[1]
        self.pool = pool6[..., first:stop, :]
        sizes = {"kv": layout.kv_planes, "token": page_size, "head": stop - first,
                 "dim": layout.head_dim}
        if isinstance(kv_tensors, torch.Tensor):
            if "layer" not in [n for g in block_layout.groups() for n in g]:
                raise ValueError(f"hostkv: {block_layout.name or block_layout.axes}: one KV "
                                 "tensor for every layer needs a 'layer' axis")
            sizes["layer"] = num_layers
            self._check_tensor(kv_tensors, dtype, block_layout)
            whole = _canonical_view(kv_tensors, block_layout, sizes)
            views = [whole[layer] for layer in range(num_layers)]
        else:
            tensors = list(kv_tensors)
            if len(tensors) != num_layers:
                raise ValueError(f"hostkv: {len(tensors)} KV tensors for "
                                 f"{num_layers} layers of pages")
            views = []
            for tensor in tensors:
                self._check_tensor(tensor, dtype, block_layout)
                views.append(_canonical_view(tensor, block_layout, sizes))
        _check_layers_agree(views)
        self.engine_views = views          # each [blocks, kv, tokens, heads, dim]
        self.device = views[0].device
        self.num_blocks = views[0].shape[0]
        itemsize = layout.itemsize
        self.plans = [CopyPlan.build(view.shape[1:],
                                     [s * itemsize for s in self.pool.stride()[2:]],
                                     [s * itemsize for s in view.stride()[1:]], itemsize)
                      for view in views]
        self.bytes_per_page = (layout.kv_planes * page_size * (stop - first) * layout.head_dim
                               * itemsize * num_layers)
        self._thread: Optional[CopyThread] = None
        self._cuda: Optional[CudaCopier] = None
        self._transfers = 0
        self._cpu_calls = 0
        if self.device.type == "cuda":
            self._cuda = self._cuda_copier(register=register, staging_bytes=staging_bytes)
        elif self.device.type != "cpu":
            raise ValueError(f"hostkv: KV tensors on {self.device}: the copy engine moves "
                             "blocks of CPU and CUDA tensors")
        elif asynchronous:
            self._thread = CopyThread()

    @staticmethod
    def _check_tensor(tensor: torch.Tensor, dtype: torch.dtype, block_layout: BlockLayout) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"hostkv: a KV tensor must be a torch.Tensor, got "
                             f"{type(tensor).__name__}")
        if tensor.dtype != dtype:
            raise ValueError(f"hostkv: {block_layout.name or block_layout.axes}: a KV tensor "
                             f"of dtype {tensor.dtype}, the pages hold {dtype}")

    def _cuda_copier(self, cuda: Optional["CudaDevice"] = None, register: bool = True,
                     staging_bytes: Optional[int] = None,
                     register_chunk_bytes: Optional[int] = None) -> "CudaCopier":
        """The GPU path, handed the views it copies between and never this engine: a copier
        that held its engine would make a reference cycle, which keeps the pool's views
        alive until the garbage collector runs, and the cache's close() raises BufferError
        while they live (a worker's shutdown would hold its lease until the process exits).

        The arguments as :class:`hostkv.cuda_copy.CudaCopier` takes them (the tests build
        the GPU path over CPU tensors with a recording stand-in for CUDA)."""
        from hostkv.cuda_copy import REGISTER_CHUNK_BYTES, CudaCopier

        return CudaCopier(self.pool, self.pool_bytes, self.engine_views, cuda=cuda,
                          register=register, staging_bytes=staging_bytes,
                          register_chunk_bytes=register_chunk_bytes or REGISTER_CHUNK_BYTES)

    def _indices(self, blocks: Sequence[int], pages: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
        """The step's block and page indices, checked (integers, equal lengths, in range)
        before anything is copied, as contiguous int64 arrays."""
        block_index = _index_array(blocks, "blocks")
        page_index = _index_array(pages, "pages")
        if block_index.shape != page_index.shape:
            raise ValueError(f"hostkv: {block_index.size} blocks for {page_index.size} pages")
        self._check_range(block_index, page_index)
        # After the range check: a uint64 index past int64's range would wrap to a
        # negative one here.
        return (np.ascontiguousarray(block_index, dtype=np.int64),
                np.ascontiguousarray(page_index, dtype=np.int64))

    def _check_range(self, block_index: np.ndarray, page_index: np.ndarray) -> None:
        if block_index.size and (block_index.min() < 0 or block_index.max() >= self.num_blocks):
            raise ValueError(f"hostkv: a block outside [0, {self.num_blocks}) in "
                             f"{block_index.tolist()[:16]}")
        if page_index.size and (page_index.min() < 0
                                or page_index.max() >= self.pool.shape[0]):
            raise ValueError(f"hostkv: a page outside [0, {self.pool.shape[0]}) in "
                             f"{page_index.tolist()[:16]}")

    def submit_save(self, blocks: Sequence[int], pages: Sequence[int]) -> Transfer:
        """Starts copying engine block ``blocks[i]`` of every layer into page ``pages[i]``.

        Answers at once. The blocks must keep their KV, and the pages their reservation,
        until the transfer is done: poll :meth:`Transfer.done` at a later step. On a GPU
        the copies wait for the work already on the current stream (the forward that
        wrote the KV); on a CPU they run on the copy thread (``asynchronous``) or inline.

        Raises:
            ValueError: an index that is not an integer (a float, a bool), unequal
                lengths or an index out of range; nothing was copied.
        """
        block_index, page_index = self._indices(blocks, pages)
        if not self.writes or block_index.size == 0:
            return Transfer.finished(0)
        nbytes = block_index.size * self.bytes_per_page
        self._transfers += 1
        if self._cuda is not None:
            return self._cuda.save(block_index, page_index, nbytes)
        if self._thread is not None:
            return self._thread.submit(
                functools.partial(self._copy, block_index, page_index, to_pool=True), nbytes)
        started = time.perf_counter()
        self._copy(block_index, page_index, to_pool=True)
        transfer = Transfer.finished(nbytes)
        transfer.seconds = time.perf_counter() - started
        return transfer

    def submit_load(self, pages: Sequence[int], blocks: Sequence[int]) -> Transfer:
        """Starts copying page ``pages[i]`` into engine block ``blocks[i]`` of every layer.

        On a CPU the copy is over when this returns (the forward needs it next). On a GPU
        it runs on the load stream, layer by layer: before a layer's attention reads its
        KV, call the transfer's ``wait_layer(layer)`` (or ``wait_all_layers()``), which
        orders the current stream after that layer's copy without blocking the host.

        Raises:
            ValueError: an index that is not an integer (a float, a bool), unequal
                lengths or an index out of range; nothing was copied.
        """
        block_index, page_index = self._indices(blocks, pages)
        nbytes = block_index.size * self.bytes_per_page
        if block_index.size:
            self._transfers += 1
        if self._cuda is not None and block_index.size:
            return self._cuda.load(page_index, block_index, nbytes)
        if block_index.size:
            self._copy(block_index, page_index, to_pool=False)
        return Transfer.finished(nbytes)

    def registration(self) -> Optional["HostRegistration"]:
        """On a GPU, the pool's registration with CUDA (``registered_bytes``, ``nbytes``,
        ``failed``, ``failures``, ``finished``); None on a CPU."""
        return self._cuda.registration if self._cuda is not None else None

    def stats(self) -> CopyStats:
        """The engine's counters since it was built: transfers, copy calls (DMA calls on a
        GPU), staging fills and bytes, registration progress and failures."""
        cuda = self._cuda
        if cuda is None:
            return CopyStats(transfers=self._transfers, copy_calls=self._cpu_calls)
        registration = cuda.registration
        return CopyStats(transfers=self._transfers, copy_calls=cuda.copy_calls,
                         pieces=cuda.pieces, staging_bytes=cuda.staging_bytes,
                         registered_bytes=registration.registered_bytes if registration else 0,
                         register_failures=registration.failures if registration else 0)

    def close(self) -> None:
        """Lets submitted copies finish, stops the copy thread and unregisters the pool
        from CUDA; the engine copies nothing afterwards."""
        if self._thread is not None:
            self._thread.close()
        if self._cuda is not None:
            self._cuda.close()

    def save(self, blocks: Sequence[int], pages: Sequence[int]) -> int:
        """Copies engine block ``blocks[i]`` of every layer into page ``pages[i]``.

        Returns:
            Bytes written (0 on a rank that does not write).

        Raises:
            ValueError: an index that is not an integer (a float, a bool), unequal
                lengths or an index out of range; nothing was copied.
        """
        transfer = self.submit_save(blocks, pages)
        transfer.wait()
        if transfer.error is not None:
            raise transfer.error
        return transfer.nbytes

    def load(self, pages: Sequence[int], blocks: Sequence[int]) -> int:
        """Copies page ``pages[i]`` into engine block ``blocks[i]`` of every layer.

        Returns:
            Bytes read.

        Raises:
            ValueError: an index that is not an integer (a float, a bool), unequal
                lengths or an index out of range; nothing was copied.
        """
        transfer = self.submit_load(pages, blocks)
        transfer.wait()
        return transfer.nbytes

    def _copy(self, block_index: np.ndarray, page_index: np.ndarray, to_pool: bool) -> None:
        """CPU blocks: for a save, every index checked and the pages this process has not
        mapped yet populated (populate_pages); then one compiled call per group of layers
        that share a plan (one call for every layout hostkv knows), without the GIL. The
        first call checks every index before any byte moves; the others check the same
        indices against the same counts."""
        cpu = self._cpu if self._cpu is not None else self._cpu_setup()
        if to_pool and cpu.mapped is not None:
            # A load needs no populate: its reads fault 16 pages in at a time by themselves
            # (measured: a cold load ran as fast without it).
            check_blocks(page_index, cpu.num_pages, block_index, self.num_blocks)
            populate_pages(cpu.pool_base, cpu.page_stride, cpu.page_stride, cpu.num_pages,
                           page_index, cpu.mapped)
        self._cpu_calls += len(cpu.groups)
        for group in cpu.groups:
            engine = (group.engine_layers, self.num_blocks, group.engine_block_stride,
                      block_index)
            pool = (group.pool_layers, cpu.num_pages, cpu.page_stride, page_index)
            plan = group.plan
            if to_pool:
                copy_layers(*pool, *engine, plan.shape, plan.pool_strides, plan.engine_strides,
                            plan.run)
            else:
                copy_layers(*engine, *pool, plan.shape, plan.engine_strides, plan.pool_strides,
                            plan.run)

    def _cpu_setup(self) -> _CpuCopies:
        """What every CPU copy of this engine hands the compiled loop, worked out once: each
        layer's address on both sides (the tensors this engine holds keep them valid), the
        layers grouped by plan and block stride, and no page populated yet."""
        itemsize = self.layout.itemsize
        layers: Dict[Tuple[CopyPlan, int], Tuple[List[int], List[int]]] = {}
        for layer, (view, plan) in enumerate(zip(self.engine_views, self.plans)):
            engine, pool = layers.setdefault((plan, view.stride(0) * itemsize), ([], []))
            engine.append(view.data_ptr())
            pool.append(self.pool[:, layer].data_ptr())
        groups = [_LayerGroup(plan, stride, np.array(engine, dtype=np.uint64),
                              np.array(pool, dtype=np.uint64))
                  for (plan, stride), (engine, pool) in layers.items()]
        num_pages = self.pool.shape[0]
        # Page 0's first byte, not this rank's first layer's or head's: a page's range spans
        # every layer and head.
        pool_base = self.pool_bytes.data_ptr()
        self._cpu = _CpuCopies(groups, num_pages, self.pool.stride(0) * itemsize, pool_base,
                               np.zeros(num_pages, dtype=np.uint8))
        return self._cpu

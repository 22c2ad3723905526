"""``CudaBackend``: the real world's ``TransferBackend`` (device <-> pinned host).

It owns the KV memory (device caches per ``ModelSpec`` and a pinned host pool),
one stream for loads (host -> device) and one for stores (device -> host), and
turns each ``TransferOp`` into per-layer work: for layer i, wait (device-side)
on layer i of every op it must follow, launch the copy, record layer i's
event; a side stream waits on that event and runs a host function that hops
to the event loop with ``call_soon_threadsafe`` to report ``layer_done(i)``
(on the side stream, so a callback waiting for the GIL never stalls a copy).
Nothing polls and the CPU never blocks: the engine orders its compute stream
after layer i with ``wait_layer`` (``cudaStreamWaitEvent``), the scheduler
awaits futures.

Storage ops (prefetch, write) belong to a storage backend; this one refuses them.
Call ``submit``/``cancel``/``wait_layer`` on the event loop's thread.

The op's handle (``CudaTask``), the host-callback hop and ``LoopThreadGC`` live in
``kernels.cuda_task``, with ``FutureSink``; they are re-exported here.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence

import numpy as np

from kernels._cuda import cupy_module
from kernels.cuda_task import (  # noqa: F401 (FutureSink, LoopThreadGC re-exported)
    CudaTask,
    FutureSink,
    LoopThreadGC,
    _dispatch,
    _host_callback,
    _loop_running,
)
from kernels.layout_copy import (
    DEFAULT_DEVICE_STAGING_BYTES,
    DEFAULT_SCATTER_CTAS,
    DEFAULT_SLOTS,
    GroupedCopier,
)
from kernels.swap import (
    DEFAULT_DMA_MIN_BYTES,
    DEFAULT_LOAD_CTAS,
    DEFAULT_MIN_RUN_BYTES,
    DEFAULT_STAGING_BYTES,
    DEFAULT_STORE_CTAS,
    BlockCopier,
    SwapKernels,
)
from kvflow.backend import submit_loop
from kvflow.errors import ConfigError, InvalidBlockId, TransferError
from kvflow.host_layout import HostGeometry, HostLayout
from kvflow.layout import ModelSpec
from kvflow.manager import TransferOp
from kvflow.radix import Tier

#: A stream priority past any device's range: CUDA clamps it to the highest priority.
HIGHEST_PRIORITY = -1000


def _stream(cp: object, priority: int | None) -> object:
    """A non-blocking stream, with a CUDA priority where one is asked for and CuPy can."""
    if priority is None:
        return cp.cuda.Stream(non_blocking=True)
    try:
        return cp.cuda.Stream(non_blocking=True, priority=priority)
    except TypeError:  # an older CuPy: create it through the runtime
        ptr = cp.cuda.runtime.streamCreateWithPriority(cp.cuda.runtime.streamNonBlocking,
                                                       priority)
        stream = cp.cuda.ExternalStream(ptr)
        stream._kvflow_owned = ptr  # (never destroyed: lives as long as the backend)
        return stream


class CudaBackend:
    """Device KV caches + pinned host pool + two streams; implements ``TransferBackend``.

    ``device_kv(layer, role)`` and ``host_kv(layer, role)`` are ``uint8`` views
    ``[num_blocks, role_bytes]`` (view them as the model's dtype as needed);
    each role of all layers is one allocation, so a layer's stride is constant
    and a run of blocks moves through all layers in one 2-D memcpy.

    ``load_ctas``/``store_ctas``: CTAs per launch each way (few: compute keeps
    the GPU). ``stream_priority``: CUDA priority of the two copy streams (None:
    the default, lowest). ``layers_per_launch`` > 1 trades per-layer granularity for less
    host time: one launch and one host callback per group of layers (each
    layer still gets its own event, recorded when its group lands).
    ``dma``/``dma_min_bytes``: when ops go to the copy engine as batched memcpys
    instead of the kernel (see ``kernels.swap``); ``use_dma`` says what was chosen.

    ``host_layout`` (``kvflow.host_layout``): how the pinned host pool is laid out.
    ``layer_major`` (the default) copies (layer, role) pieces straight between the
    pool and the caches, as above; ``grouped:G`` and ``block_major`` keep a block's
    layers together on the host and copy G layers a piece through a device staging
    ring and a D2D scatter (``kernels.layout_copy``; ``scatter_ctas`` SMs,
    ``device_staging_bytes`` per direction): a group's layers land together, so their
    events and ``layer_done`` come together (``layers_per_launch`` is then G).

    ``eager_layers``: ``submit`` enqueues an op's first ``eager_layers`` layers at
    once and the rest when someone needs them (``wait_layer``/``layer_event`` on
    a layer, the next op on its stream or one that depends on it, ``pump`` from
    the compute's enqueue loop) or on the event loop's next turn, whichever is
    first (``None``: every layer at submit). Enqueueing 32 layers costs the CPU
    ~0.5-1.2 ms; done up front it delays the step that overlaps the load by
    that much while the GPU has the first layers long landed (measured: the
    step's late start, not any wait on a layer, was what cost the overlap).
    Deferred layers are paced by the host, which the simulator does not model;
    ops of models with at most ``eager_layers`` layers are not deferred at all.
    Only while an event loop runs; otherwise every layer is enqueued at submit.

    ``one_launch`` (``None``: ``ONE_LAUNCH_DEFAULT``, on): an op the swap kernel
    moves whole (``layer_major``, pieces under ``dma_min_bytes``, no runs for the copy
    engine) is one launch of the signalling kernel, which marks each layer in a
    progress word as it lands (``kernels.progress``): waits on its layers are
    ``cuStreamWaitValue32`` on those words, and the whole op is enqueued at submit
    (H100 host: a launch costs ~5.5 us of CPU, 32 per-layer launches ~190 us; one
    launch ~10 us, at 1.02-1.08x the per-layer launches' bandwidth). The kernel's
    warps take units from one counter in layer order, so layers land when they would
    with a launch per layer (``benchmarks/results/host_layouts.md``; before, with a
    fixed share per warp, layer 23 of 32 landed at 0.93 of the op against 0.75), and
    the words flip in layer order.
    A sink that reads layers lazily (``lazy_layers``: the runtime's tasks) gets a
    host function at the op's end and for the layers it awaits only (~19 us of CPU
    each); others get one per launch unit, as before.
    """

    #: ``one_launch`` when not given (benchmarks flip it for a whole process).
    ONE_LAUNCH_DEFAULT = True

    def __init__(
        self,
        spec: ModelSpec,
        num_device_blocks: int,
        num_host_blocks: int,
        *,
        load_ctas: int = DEFAULT_LOAD_CTAS,
        store_ctas: int = DEFAULT_STORE_CTAS,
        min_run_bytes: int = DEFAULT_MIN_RUN_BYTES,
        layers_per_launch: int = 1,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        device: int | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        stream_priority: int | None = None,
        dma: str = "auto",
        dma_min_bytes: int = DEFAULT_DMA_MIN_BYTES,
        eager_layers: int | None = 4,
        host_layout: str = "layer_major",
        scatter_ctas: int = DEFAULT_SCATTER_CTAS,
        device_staging_bytes: int = DEFAULT_DEVICE_STAGING_BYTES,
        staging_slots: int = DEFAULT_SLOTS,
        one_launch: bool | None = None,
    ) -> None:
        sizes = (("num_device_blocks", num_device_blocks), ("num_host_blocks", num_host_blocks))
        sizes += (("layers_per_launch", layers_per_launch),)
        if eager_layers is not None:
            sizes += (("eager_layers", eager_layers),)
        for name, v in sizes:
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"CudaBackend {name} must be a positive integer, got {v!r}")
        cp = cupy_module()
        self._cp = cp
        self.spec = spec
        self.layout = spec.layout
        self.num_layers = self.layout.num_layers
        self.roles = tuple(r.name for r in self.layout.roles)
        self.role_bytes = tuple(r.bytes_per_block for r in self.layout.roles)
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self.host_layout = HostLayout.parse(host_layout)
        self.host_geometry = HostGeometry(self.host_layout, self.layout.num_layers,
                                          num_host_blocks, self.role_bytes)
        if self.host_layout.block_contiguous:  # a group lands as a whole
            layers_per_launch = self.host_layout.group_size(self.layout.num_layers)
        self.layers_per_launch = layers_per_launch
        self.device = cp.cuda.runtime.getDevice() if device is None else device
        self._loop = loop
        self._event_pool: list[object] = []
        #: Give every task a ``start_event`` and an ``end_event`` (replays time each op's
        #: service with them).
        self.record_starts = False
        self.eager_layers = self.num_layers if eager_layers is None else eager_layers
        #: Move a kernel-path op (``layer_major``, no copy-engine runs) with one signalling
        #: launch whose progress words mark each layer (``kernels.progress``), instead of a
        #: launch and an event per layer; off (or no stream memory operations): per layer.
        self.one_launch = self.ONE_LAUNCH_DEFAULT if one_launch is None else one_launch
        #: Per copy stream, the one task with layers still to enqueue (only the
        #: stream's latest op can have any: a new op first enqueues the rest).
        self._tails: dict[int, CudaTask] = {}
        self._flush_scheduled = False
        #: Tasks with host callbacks still to come, by key (loop thread only); the
        #: callbacks name the backend by weak reference and the task by key.
        self._live: dict[int, CudaTask] = {}
        self._ref = weakref.ref(self)
        L = self.num_layers
        with cp.cuda.Device(self.device):
            self._dev = [cp.empty((L, num_device_blocks, b), dtype=np.uint8)
                         for b in self.role_bytes]
            geo = self.host_geometry
            # One pinned buffer in the host layout; host_kv(layer, role) views into it.
            self._host_buf = cp.cuda.alloc_pinned_memory(geo.total_bytes)
            self._host_flat = np.ndarray((geo.total_bytes,), dtype=np.uint8,
                                         buffer=self._host_buf)
            hptr = int(self._host_buf.ptr)
            host_off = geo.layer_role_bases()
            block_stride = [[geo.offset(1, layer, r) - geo.offset(0, layer, r)
                             if num_host_blocks > 1 else b for r, b in enumerate(self.role_bytes)]
                            for layer in range(L)]
            self._host = [[np.ndarray((num_host_blocks, b), dtype=np.uint8,
                                      buffer=self._host_buf, offset=host_off[layer][r],
                                      strides=(block_stride[layer][r], 1))
                           for layer in range(L)] for r, b in enumerate(self.role_bytes)]
            # stream_priority (CUDA: lower is higher): the block scheduler places a
            # higher-priority stream's CTAs first, so copies get SMs while compute runs.
            self.load_stream = _stream(cp, stream_priority)
            self.store_stream = _stream(cp, stream_priority)
            # Host functions block their stream until Python (the GIL) runs them, so
            # they go on side streams that wait on the layer events: copies never stall.
            self._load_notify = cp.cuda.Stream(non_blocking=True)
            self._store_notify = cp.cuda.Stream(non_blocking=True)
            # Reports a lazy sink asks for (``_watch``), beside the op ends on the above.
            self._watchers = {id(n): cp.cuda.Stream(non_blocking=True)
                              for n in (self._load_notify, self._store_notify)}
            self._event_stream: object = None
            kernels = SwapKernels(self.device)
            dev_bases = np.array([[a.data.ptr + layer * a.strides[0] for a in self._dev]
                                  for layer in range(L)], dtype=np.int64)
            host_bases = np.array([[hptr + o for o in row] for row in host_off], dtype=np.int64)
            if not self.host_layout.block_contiguous:
                common = dict(min_run_bytes=min_run_bytes, staging_bytes=staging_bytes,
                              kernels=kernels, dma=dma, dma_min_bytes=dma_min_bytes)
                self.h2d: BlockCopier | GroupedCopier = BlockCopier(
                    host_bases, dev_bases, self.role_bytes, num_host_blocks,
                    num_device_blocks, ctas=load_ctas, src_name="host", dst_name="device",
                    **common)
                self.d2h: BlockCopier | GroupedCopier = BlockCopier(
                    dev_bases, host_bases, self.role_bytes, num_device_blocks,
                    num_host_blocks, ctas=store_ctas, src_name="device", dst_name="host",
                    **common)
            else:
                # The kernel side of each direction gets its own stream, so a chunk's
                # scatter (or gather) overlaps the next chunk's copy; the copies stay on
                # the two copy streams, as in layer_major.
                self.load_tail = _stream(cp, stream_priority)
                self.store_head = _stream(cp, stream_priority)
                common = dict(kernels=kernels, ctas=scatter_ctas, dma=dma,
                              staging_bytes=device_staging_bytes, slots=staging_slots)
                self.h2d = GroupedCopier(geo, hptr, dev_bases, num_device_blocks,
                                         to_device=True, head=self.load_stream,
                                         tail=self.load_tail, **common)
                self.d2h = GroupedCopier(geo, hptr, dev_bases, num_device_blocks,
                                         to_device=False, head=self.store_head,
                                         tail=self.store_stream, **common)
        self.use_dma = self.h2d.use_dma

    # ------------------------------------------------------------------ memory
    def device_kv(self, layer: int, role: str) -> object:
        """``cupy`` uint8 ``[num_device_blocks, role_bytes]`` of one layer and role."""
        return self._dev[self.roles.index(role)][layer]

    def host_kv(self, layer: int, role: str) -> np.ndarray:
        """Pinned ``numpy`` uint8 ``[num_host_blocks, role_bytes]`` of one layer and role
        (strided across blocks where the host layout keeps a block's layers together)."""
        return self._host[self.roles.index(role)][layer]

    def host_block_view(self, block_id: int) -> np.ndarray | None:
        """A whole host block in the store's order (``[layer][role]``) where the layout
        keeps it contiguous (``block_major``); else ``None``."""
        off = self.host_geometry.block_offset(block_id)
        if off is None:
            return None
        return self._host_flat[off: off + self.host_geometry.bytes_per_block]

    # ------------------------------------------------------------------ protocol
    def submit(self, op: TransferOp, sink: object, after: Sequence[object] = ()) -> CudaTask:
        """Enqueue ``op`` layer by layer; never blocks the CPU on the GPU.

        Bad ids: nothing is enqueued or written and ``sink.done(InvalidBlockId)``
        follows on the loop. An op that touches storage raises ``TransferError``
        at once (a configuration mistake: this backend has no storage tier).
        """
        copier, stream, notify = self._route(op)
        loop = self._event_loop()
        L = self.num_layers
        task = CudaTask(op, sink, loop, stream, _owner=self, notify=notify, num_layers=L,
                        lazy=getattr(sink, "lazy_layers", False) is True)
        try:
            prep = copier.prepare(op.src_ids, op.dst_ids, stream)
        except InvalidBlockId as exc:
            task.error = exc
            task.finished = True
            loop.call_soon(sink.done, exc)
            return task
        task.prep = prep
        if self.one_launch and copier.signals(prep):  # one launch, a word per layer
            task.words = copier.progress
            task.seq = copier.progress.take()
        else:  # an event per launch unit, shared by its layers (they land together)
            k = self.layers_per_launch
            ev = self._take_events(-(-L // k))
            task.events = ev if k == 1 else [ev[i // k] for i in range(L)]
        task.started = True
        self._live[task.key] = task
        self._finish_tail(stream)  # same-stream order: the previous op's layers first
        # Same-stream predecessors are already ordered; finished ones are past.
        task.deps = [h for h in after if isinstance(h, CudaTask) and h.started
                     and not h.finished and h.stream is not stream]
        if self.eager_layers >= L or not _loop_running(loop):
            self._enqueue_layers(task, L - 1)
            return task
        self._enqueue_layers(task, self.eager_layers - 1)
        if task.next_layer < L:
            self._tails[id(stream)] = task
            if not self._flush_scheduled:
                self._flush_scheduled = True
                loop.call_soon(self._flush_tails)
        return task

    def _wait(self, stream: object, task: CudaTask, layer: int) -> None:
        """``stream`` waits (on the GPU) until layer ``layer`` of ``task`` has landed; a word
        already saying so (a read of pinned memory, 0.4 us) saves the wait (3.2 us)."""
        if task.words is not None:
            if not task.landed(layer):
                task.words.wait(stream.ptr, layer, task.seq)  # type: ignore[attr-defined]
        else:
            stream.wait_event(task.events[layer])  # type: ignore[attr-defined]

    def _notify(self, task: CudaTask, first: int, count: int, on: object = None) -> None:
        """A host function (on ``on``, default the task's notify stream) reports layers
        ``first .. first+count-1`` once the last has landed."""
        last = first + count - 1
        on = task.notify if on is None else on
        if task.words is not None:
            task.words.wait(on.ptr, last, task.seq)  # type: ignore[attr-defined]
        else:
            on.wait_event(task.events[last])  # type: ignore[attr-defined]
        on.launch_host_func(_host_callback,  # type: ignore[attr-defined]
                            (task.loop, self._ref, task.key, first, count))

    def _enqueue_layers(self, task: CudaTask, through: int) -> None:
        """Enqueue ``task``'s layer groups up to the one holding layer ``through``."""
        copier = self.h2d if task.stream is self.load_stream else self.d2h
        stream, events = task.stream, task.events
        tail = getattr(copier, "tail", stream)  # where the copied layers are complete
        L = self.num_layers
        # One signalling launch moves every layer; else a launch per group of layers.
        k = L if task.words is not None else self.layers_per_launch
        layer = task.next_layer
        try:
            while layer <= through and layer < L:
                count = min(k, L - layer)
                last = layer + count - 1
                for h in task.deps:  # layers land in order: waiting on `last` covers the group
                    if not h.finished:
                        self._ensure(h, last)
                        self._wait(stream, h, last)
                if layer == 0 and self.record_starts:
                    task.start_event = self._cp.cuda.Event()
                    task.start_event.record(stream)
                if task.words is not None:
                    copier.launch_signal(task.prep, stream, task.seq)
                else:
                    copier.launch(task.prep, stream, layer, count)
                if last == L - 1 and self.record_starts:
                    task.end_event = self._cp.cuda.Event()
                    task.end_event.record(tail)
                if events:
                    events[last].record(tail)  # (shared by the unit's layers)
                first, layer = layer, last + 1
                task.next_layer = layer
                if not task.lazy:  # every layer reported, a host function per launch unit
                    if task.words is None:
                        self._notify(task, first, count)
                    else:
                        for i in range(first, last + 1):
                            self._notify(task, i, 1)
                elif layer == L:  # lazy: the op's end; layers on request (``_watch``)
                    self._notify(task, L - 1, 1)
        except Exception as exc:  # a CUDA error while enqueueing: report it, keep order
            task.next_layer = L
            task.limit = layer
            task.error = TransferError(
                f"op {task.op.op_id}: enqueueing layer {layer} failed: {exc}")
            task.error.__cause__ = exc
            try:
                for i in range(layer, L):  # dependents must not wait on stale marks
                    if task.words is not None:
                        task.words.write(tail.ptr, i, task.seq)  # type: ignore[attr-defined]
                    else:
                        events[i].record(tail)
                self._notify(task, L - 1, 1)
                # (the callback ends it: ``error`` is set, so nothing more is reported)
            except Exception:
                task.loop.call_soon(task._finish, False)
        if task.next_layer >= L:
            task.deps = []
            if self._tails.get(id(stream)) is task:
                del self._tails[id(stream)]

    def _watch(self, task: CudaTask, layer: int) -> None:
        """A lazy sink awaits ``layer``: a host function reports it once it lands (or a
        report on the loop's next turn, if it has)."""
        if task.finished or not task.lazy or layer <= task.watched or task.error is not None:
            return
        if not 0 <= layer < self.num_layers:
            return
        self._ensure(task, layer)
        task.watched = layer
        if task.landed(layer):
            task.loop.call_soon(_dispatch, self._ref, task.key, layer, 1)
        else:  # not behind the notify stream's op ends: a stream of its own per direction
            self._notify(task, layer, 1, self._watchers[id(task.notify)])

    def _ensure(self, task: CudaTask, layer: int) -> None:
        """Layer ``layer`` of ``task`` (and all before it) is enqueued."""
        if task.next_layer <= layer and not task.finished:
            self._enqueue_layers(task, layer)

    def _finish_tail(self, stream: object) -> None:
        task = self._tails.pop(id(stream), None)
        if task is not None:
            self._enqueue_layers(task, self.num_layers - 1)

    def flush(self) -> None:
        """Enqueue every deferred layer now: for callers that record their own events on
        the copy streams and mean "after what was submitted"."""
        self._flush_tails()

    def _flush_tails(self) -> None:
        """Enqueue every deferred layer (the loop's next turn, or before a sync)."""
        self._flush_scheduled = False
        for task in list(self._tails.values()):
            self._enqueue_layers(task, self.num_layers - 1)
        self._tails.clear()

    def pump(self) -> None:
        """Enqueue one more layer group of every op with deferred layers.

        The compute's enqueue loop calls it once per layer, so ops it does
        not wait on (backups, other requests' loads) keep their streams fed
        while it runs, instead of idling until the loop's next turn.
        """
        if not self._tails:
            return
        for task in list(self._tails.values()):
            self._enqueue_layers(task, task.next_layer)

    def cancel(self, handle: object) -> None:
        """Stop reporting ``handle``; its sink gets ``done(TransferError)`` once the GPU is past it.

        Work already enqueued still runs (CUDA cannot recall it), so ``done``
        waits for it: until then the destination blocks may still be written.
        """
        task = self._task(handle)
        if not task.finished:
            task.limit = task.layers_reported()  # nothing past what has landed by now
            task.cancelled = True

    def wait_layer(self, stream: object, handle: object, layer: int) -> None:
        """Make ``stream`` (the engine's compute stream) wait, on the GPU, for layer ``layer``."""
        task = self._task(handle)
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        if not task.started:
            raise TransferError(f"op {task.op.op_id} failed before it started: {task.error}")
        if task.finished:
            return  # the GPU is past every layer of it
        self._ensure(task, layer)
        self._wait(stream, task, layer)

    def layer_event(self, handle: object, layer: int) -> object | None:
        """The CUDA event recorded after layer ``layer`` (``None`` once the op has finished)."""
        task = self._task(handle)
        if task.finished:
            return None
        self._ensure(task, layer)
        if task.words is None:
            return task.events[layer]
        if self._event_stream is None:  # an event after the word (rare: tests, tools)
            self._event_stream = self._cp.cuda.Stream(non_blocking=True)
        self._wait(self._event_stream, task, layer)
        ev = self._cp.cuda.Event(disable_timing=True)
        ev.record(self._event_stream)
        return ev

    def synchronize(self) -> None:
        """Block until both streams are idle (tests, shutdown; never on the hot path)."""
        self._flush_tails()
        for s in (self.load_stream, self.store_stream, self._load_notify, self._store_notify,
                  *self._watchers.values(), getattr(self.h2d, "tail", None),
                  getattr(self.d2h, "head", None)):
            if s is not None:
                s.synchronize()

    # ------------------------------------------------------------------ internals
    def _route(self, op: TransferOp) -> tuple[BlockCopier | GroupedCopier, object, object]:
        src, dst = Tier(op.src_tier), Tier(op.dst_tier)
        if src == Tier.HOST and dst == Tier.DEVICE:
            return self.h2d, self.load_stream, self._load_notify
        if src == Tier.DEVICE and dst == Tier.HOST:
            # (a host layout's backups start on the gather kernel's stream: the head)
            return self.d2h, getattr(self.d2h, "head", self.store_stream), self._store_notify
        raise TransferError(
            f"CudaBackend moves blocks between device and host only; op {op.op_id} "
            f"({op.kind.value}) goes {src.name.lower()} -> {dst.name.lower()}: "
            "storage transfers need a storage backend"
        )

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        return submit_loop(self._loop, "CudaBackend.submit")

    def _take_events(self, n: int) -> list[object]:
        pool = self._event_pool
        events = pool[-n:] if n <= len(pool) else []
        if events:
            del pool[-n:]
        else:
            with self._cp.cuda.Device(self.device):
                events = [self._cp.cuda.Event(disable_timing=True) for _ in range(n)]
        return events

    def _release_events(self, events: list[object]) -> None:
        if events:  # (a unit's layers share one event: ``submit``)
            self._event_pool.extend(events[::self.layers_per_launch])

    @staticmethod
    def _task(handle: object) -> CudaTask:
        if not isinstance(handle, CudaTask):
            raise TypeError(f"not a CudaBackend handle: {handle!r}")
        return handle

"""What a submitted op becomes in the CUDA world, and how the GPU's progress reaches the
event loop.

``CudaTask`` is the handle ``CudaBackend.submit`` returns. Each layer's copy is
followed, on a side stream, by a host function that runs on a CUDA driver thread
and only hops to the loop (``_host_callback``), where ``_dispatch`` reports the
layers to the task's sink. ``LoopThreadGC`` keeps the garbage collector off the
driver threads; ``FutureSink`` is a plain sink for tests, benchmarks and simple
callers. Kept apart from ``kernels.backend``, which decides what to enqueue.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kernels.swap import PreparedCopy
from kvflow.errors import TransferError
from kvflow.manager import TransferOp

if TYPE_CHECKING:
    from kernels.backend import CudaBackend


@dataclass(eq=False)
class CudaTask:
    """Handle of one submitted op: what ``after``, ``cancel`` and ``wait_layer`` take.

    How a layer says it has landed: a CUDA event per layer (``events``), or, for
    an op moved by one signalling kernel launch, a progress word per layer
    (``words``/``seq``, ``kernels.progress``). Either way ``landed(i)`` reads it
    without blocking, and ``CudaBackend._wait`` makes a stream wait for it.

    Lazy reports (``lazy_layers``, the runtime's tasks): the sink reads
    ``layers_reported()`` from the handle and ``watch(i)`` asks for a report of
    layer i, so only the op's end and the layers something awaits cost a host
    function (~19 us of CPU each on the H100 host); other sinks get every layer.
    """

    op: TransferOp
    sink: object
    loop: asyncio.AbstractEventLoop
    stream: object = None
    events: list[object] = field(default_factory=list)
    prep: PreparedCopy | None = None
    error: BaseException | None = None
    cancelled: bool = False
    finished: bool = False
    #: False when the op failed before anything was enqueued (nothing was written).
    started: bool = False
    #: With ``CudaBackend.record_starts``: a timing event recorded once the first layer's
    #: waits are enqueued, right before its copy (it completes when the op starts on its link),
    #: and one right after the last layer's copy.
    start_event: object = None
    end_event: object = None
    _owner: CudaBackend | None = field(default=None, repr=False)
    #: Names the task to its host callbacks (see ``_host_callback``).
    key: int = field(default_factory=lambda: next(_KEYS))
    #: First layer not enqueued yet (``num_layers`` once all are; ``CudaBackend.eager_layers``).
    next_layer: int = 0
    #: Same-direction ops it must follow on other streams, waited on group by group.
    deps: list[CudaTask] = field(default_factory=list, repr=False)
    notify: object = field(default=None, repr=False)
    num_layers: int = 0
    #: The progress words (``kernels.progress.ProgressWords``) and this op's sequence
    #: number, where one signalling launch moves the op (else ``None`` and ``events``).
    words: object = field(default=None, repr=False)
    seq: int = 0
    #: Whether the sink reads layers from the handle (``lazy_layers``).
    lazy: bool = False
    #: Highest layer with a report already asked of the notify stream.
    watched: int = -1
    #: Layers known landed (a cache: they land in order).
    _seen: int = 0
    #: Reports stop here (cancel, enqueue error): layers past it are not vouched for.
    limit: int | None = None

    @property
    def lazy_layers(self) -> bool:
        """The ``LayerSink`` protocol's opt-in, answered for the sink (see the class doc)."""
        return self.lazy

    def landed(self, layer: int) -> bool:
        """Whether the GPU is past layer ``layer`` (no CUDA call on the progress-word path)."""
        if layer >= self.next_layer:
            return False
        if self.words is not None:
            return self.words.landed(layer, self.seq)  # type: ignore[attr-defined]
        return bool(self.events[layer].done)  # type: ignore[attr-defined]

    def layers_reported(self) -> int:
        """Layers landed by now, in order (the runtime's ``layers_done`` while running)."""
        n = self._seen
        if not self.finished:
            L = self.num_layers
            while n < L and self.landed(n):
                n += 1
            self._seen = n
        return n if self.limit is None else min(n, self.limit)

    def watch(self, layer: int) -> None:
        """A lazy sink awaits ``layer``: report it once it lands."""
        if self._owner is not None:
            self._owner._watch(self, layer)

    def _on_layers(self, first: int, count: int) -> None:
        """On the loop thread: the GPU has passed layers ``first .. first+count-1``.

        ``count == 0`` marks the end after an enqueueing error.
        """
        if self.finished:
            return
        if not self.cancelled and self.error is None:
            for layer in range(first, first + count):
                self.sink.layer_done(layer)
            self._seen = max(self._seen, first + count)
        if count == 0 or first + count == self.num_layers:
            self._finish(release=True)

    def _finish(self, release: bool) -> None:
        if self.limit is None and (self.cancelled or self.error is not None):
            self.limit = self._seen
        self._seen = self.num_layers if self.limit is None else self.limit
        self.finished = True
        self.deps = []
        if self._owner is not None:
            self._owner._live.pop(self.key, None)
        if release and self._owner is not None:
            self._owner._release_events(self.events)
        self.events = []
        if release and self.prep is not None:  # else the GPU may still read the ids
            self.prep.release()
            self.prep = None
        error = self.error
        if error is None and self.cancelled:
            error = TransferError(f"op {self.op.op_id} ({self.op.kind.value}) was cancelled")
        self.sink.done(error)


_KEYS = itertools.count()


def _loop_running(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` runs in this thread now (so a ``call_soon`` will come)."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _host_callback(arg: tuple[asyncio.AbstractEventLoop, weakref.ref, int, int, int]) -> None:
    """Runs on a CUDA driver thread: hop to the loop; never raise, never call CUDA.

    The argument names the task by key rather than holding it: the driver
    drops its reference to the argument on this thread, and whatever dies
    with the last reference (a task, its CUDA events) must not die here,
    where CUDA calls fail (``cudaErrorNotPermitted``).
    """
    loop, owner, key, first, count = arg
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
        loop.call_soon_threadsafe(_dispatch, owner, key, first, count)


def _dispatch(owner: weakref.ref, key: int, first: int, count: int) -> None:
    """On the loop thread: the task's layers have landed (if the backend and task live)."""
    backend = owner()
    task = None if backend is None else backend._live.get(key)
    if task is not None:
        task._on_layers(first, count)


class LoopThreadGC:
    """Runs the cyclic garbage collector on the event loop's thread only, while active.

    Python collects cycles in whichever thread happens to allocate past a
    threshold, and CUDA host callbacks allocate on a driver thread: a
    collection there destroys whatever CUDA objects (events, memory) the
    garbage holds, and CUDA refuses calls from a host callback
    (``cudaErrorNotPermitted``; the object leaks). While active, automatic
    collection is off and the young generations are collected every
    ``interval_s`` on the loop (about a millisecond each); ``stop`` collects
    everything once and turns automatic collection back on.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float = 0.5) -> None:
        self._loop = loop
        self._interval = interval_s
        self._was_enabled = gc.isenabled()
        self._handle: asyncio.TimerHandle | None = None
        gc.disable()
        self._tick()

    def _tick(self) -> None:
        gc.collect(1)
        self._handle = self._loop.call_later(self._interval, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        gc.collect()
        if self._was_enabled:
            gc.enable()


class FutureSink:
    """A ``LayerSink`` holding one asyncio future per layer and one for the whole op.

    The runtime has its own sink; this one is for tests, benchmarks and simple
    callers that want ``await sink.layers[i]``.
    """

    def __init__(self, num_layers: int, loop: asyncio.AbstractEventLoop | None = None) -> None:
        loop = loop or asyncio.get_running_loop()
        self.layers = [loop.create_future() for _ in range(num_layers)]
        self.finished: asyncio.Future[None] = loop.create_future()
        self.reported: list[int] = []

    def layer_done(self, layer: int) -> None:
        self.reported.append(layer)
        self.layers[layer].set_result(layer)

    def done(self, error: BaseException | None = None) -> None:
        for fut in self.layers:
            if not fut.done():
                fut.set_exception(error or TransferError("op finished without this layer"))
                fut.exception()  # mark retrieved: the op's own future carries the error
        if error is None:
            self.finished.set_result(None)
        else:
            self.finished.set_exception(error)

    async def wait(self) -> None:
        await self.finished

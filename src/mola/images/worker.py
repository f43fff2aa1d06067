"""The image worker: one thread that alone touches the image model and its arrays.

MLX keeps streams per thread, so the model is loaded, LoRA files are read, slots
are written and every denoising loop runs here, on a stream this thread makes
(as mola.engine.engine does for text). Other threads hand it requests on a queue
and hear back through concurrent futures; they never see an mx.array.

Each turn is schedule -> run -> postprocess: :func:`mola.images.batch.next_batch`
takes the oldest waiting image and every other one of its size and steps, up to
``max_batch`` rows; :class:`mola.images.slots.ImageSlots` puts each LoRA set of
the batch in a slot; :func:`mola.images.generate.generate` runs one loop for all
rows; each finished request gets its PNGs.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import traceback
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import mlx.core as mx

from ..errors import EngineUnavailable, MolaError, Overloaded, ShuttingDown
from .batch import Pending, next_batch
from .request import ImageJob

log = logging.getLogger("mola.images")

MAX_WAITING_IMAGES = 64  # images queued beyond the running batch; past it, 429


@dataclass
class Ticket:
    """One request: its images, filled in as their batches finish."""

    jobs: list[ImageJob]
    future: Future = field(default_factory=Future)
    images: dict[int, bytes] = field(default_factory=dict)  # index in jobs -> PNG bytes

    def fail(self, error: BaseException) -> None:
        with contextlib.suppress(InvalidStateError):  # done, or cancelled meanwhile by its caller
            self.future.set_exception(error)

    def put(self, index: int, png: bytes) -> None:
        self.images[index] = png
        if len(self.images) == len(self.jobs):
            with contextlib.suppress(InvalidStateError):
                self.future.set_result([self.images[i] for i in range(len(self.jobs))])


class ImageWorker:
    def __init__(self, path: str, dtype: str, max_batch: int, max_rank: int):
        self.path = path
        self.dtype = dtype
        self.max_batch = max_batch
        self.max_rank = max_rank
        self._inbox: queue.Queue = queue.Queue()  # Tickets, calls (call()), None (wake up)
        self._waiting = 0  # images submitted and not yet taken into a batch
        self._lock = threading.Lock()  # guards _waiting
        self._slots = None  # ImageSlots: the model and its slots (worker thread only)
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None
        self.batches = 0  # batches run
        self.batch_rows: list[int] = []  # rows of each batch run, last 100 (read by tests and the benchmark)

    # ---- any thread -------------------------------------------------------

    def start(self, timeout: float | None = None) -> None:
        """Start the thread and wait until the model is loaded (raising why not)."""
        self._thread = threading.Thread(target=self._main, name="mola-images", daemon=True)
        self._thread.start()
        self._ready.wait(timeout)
        if self.error is not None:
            raise self.error
        if not self._ready.is_set():
            raise TimeoutError("the image worker did not finish loading its model in time")

    def stop(self, timeout: float | None = 30.0) -> None:
        self._stopping = True
        self._inbox.put(None)  # wake the loop
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def waiting(self) -> int:
        """Images submitted and not yet taken into a batch."""
        return self._waiting

    def call(self, fn) -> Future:
        """Run ``fn()`` on the worker thread between batches; its result in the future
        (a test holds the worker on a gate this way, so that requests queue up behind it)."""
        future: Future = Future()

        def run():
            try:
                future.set_result(fn())
            except BaseException as e:
                future.set_exception(e)

        self._inbox.put(run)
        return future

    def submit(self, jobs: list[ImageJob]) -> Future:
        """Queue one request's images; the future gives their PNG bytes in order."""
        if self._stopping:
            raise ShuttingDown("The server is shutting down.")
        if not self.is_alive:
            raise EngineUnavailable(f"The image worker is not running{': ' + str(self.error) if self.error else ''}.")
        with self._lock:
            if self._waiting + len(jobs) > MAX_WAITING_IMAGES:
                raise Overloaded(f"{self._waiting} images are waiting; try again later.")
            self._waiting += len(jobs)
        ticket = Ticket(list(jobs))
        self._inbox.put(ticket)
        return ticket.future

    # ---- the thread --------------------------------------------------------

    def _main(self) -> None:
        stream = mx.new_stream(mx.default_device())
        with mx.stream(stream):
            try:
                from .slots import ImageSlots
                self._slots = ImageSlots.load(self.path, self.dtype, self.max_batch, self.max_rank)
            except BaseException as e:
                self.error = e
                self._ready.set()
                mx.synchronize(stream)
                mx.clear_streams()
                return
            self._ready.set()
            pending: list[Pending] = []
            try:
                while not self._stopping:
                    self._take(pending, block=not pending)
                    if pending and not self._stopping:
                        self._step(next_batch(pending, self.max_batch))
            except BaseException as e:
                log.error("image worker died:\n%s", traceback.format_exc())
                self.error = e
            finally:
                self._fail_all(pending)
                mx.synchronize(stream)
                mx.clear_streams()  # before the thread ends, or the process may abort at exit

    def _take(self, pending: list[Pending], block: bool) -> None:
        """Move what the inbox holds into ``pending`` (waiting for one item when ``block``)."""
        try:
            item = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
            while True:
                if callable(item):
                    item()
                elif item is not None:
                    pending += [Pending(job, item, i) for i, job in enumerate(item.jobs)]
                item = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _step(self, batch: list[Pending]) -> None:
        """Schedule (slots) -> run (one denoising loop) -> postprocess (PNGs to their tickets)."""
        with self._lock:
            self._waiting -= len(batch)
        try:
            self._run(batch)
        except Exception as e:  # the batch fails, not the worker (as the text engine fails one step)
            log.error("image batch failed:\n%s", traceback.format_exc())
            error = e if isinstance(e, MolaError) else EngineUnavailable(f"The image batch failed: "
                                                                         f"{type(e).__name__}: {e}")
            for item in batch:
                item.ticket.fail(error)

    def _run(self, batch: list[Pending]) -> None:
        rows, failed = self._slots.place(batch)
        for item, error in failed:
            item.ticket.fail(error)
        rows = [(item, row) for item, row in rows if not item.ticket.future.done()]
        if not rows:
            return
        job = rows[0][0].job
        images = self._slots.run([row for _, row in rows], job.width, job.height, job.steps)
        self.batches += 1
        self.batch_rows = [*self.batch_rows[-99:], len(rows)]
        for (item, _), png in zip(rows, images):
            item.ticket.put(item.index, png)

    def _fail_all(self, pending: list[Pending]) -> None:
        error = ShuttingDown("The server is shutting down.") if self.error is None else EngineUnavailable(
            f"The image worker stopped: {self.error}")
        for item in pending:
            item.ticket.fail(error)
        while True:
            try:
                ticket = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(ticket, Ticket):
                ticket.fail(error)

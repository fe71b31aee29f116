"""A prepare's worker processes, and the SIGINT and SIGTERM that stop it, workers and all, at once.

`Workers.map` runs a task function (encode.py) over a stream of tasks, in order: in a pool of
processes started by a fork server, a bounded window of tasks in flight, or in this process. While
a prepare runs, SIGINT and SIGTERM raise `Interrupted` in the main thread (`stopping_on_signals`),
held back while worker processes start or stop or the dataset is swapped in (`uninterrupted`); a
pool stopped that way has its workers terminated at once, and a worker ends by itself when the
main process is gone, even by kill -9.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import forkserver
from typing import Any, TypeVar

from pretrain.data.chunks import Chunk
from pretrain.data.encode import Setup, init_worker

T = TypeVar("T")


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped a prepare. Raised in the main thread (held back while worker
    processes start or stop, or the dataset is swapped in), so that every `finally` runs: the
    workers are stopped, the staging directory removed, the lock released. Its message says what
    is left; `signum` gives the exit status (128 + signum)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        super().__init__(f"interrupted ({self.what}): data prepare stopped")


class _Signals:
    depth = 0  # inside `uninterrupted`: a signal is held until it ends
    held: int | None = None


def _on_signal(signum: int, frame: Any) -> None:
    if _Signals.depth:
        _Signals.held = _Signals.held or signum
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while worker processes start or stop (a process left half started
    would outlive this one) or the dataset is swapped in; raise Interrupted once it is done."""
    _Signals.depth += 1
    try:
        yield
    finally:
        _Signals.depth -= 1
        if _Signals.depth == 0 and _Signals.held is not None:
            signum, _Signals.held = _Signals.held, None
            raise Interrupted(signum)


@contextlib.contextmanager
def stopping_on_signals() -> Iterator[None]:
    """While prepare runs: SIGINT and SIGTERM raise Interrupted (instead of a traceback, or of a
    death that leaves the workers behind), where this process (its main thread) has no handler of
    its own for them; `train` installs its own only after prepare."""
    installed: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
                installed[sig] = signal.signal(sig, _on_signal)
    try:
        yield
    finally:
        for signum, previous in installed.items():
            signal.signal(signum, previous)
        if installed:
            _Signals.held = None


class Workers:
    """Runs task functions in order over a stream of tasks: in worker processes, or in this
    process when there is only one task (or workers=0)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def map(
        self, fn: Callable[[list[Chunk]], T], setup: Setup, tasks: Iterator[list[Chunk]]
    ) -> Generator[tuple[list[Chunk], T], None, None]:
        if self.n == 0:
            init_worker(setup)
            for task in tasks:
                yield task, fn(task)
            return
        # The workers watch the read end: end of file when this process is gone, even by kill -9.
        main_alive, keep_alive = multiprocessing.Pipe(duplex=False)
        executor: ProcessPoolExecutor | None = None
        pending: deque[tuple[list[Chunk], Future[T]]] = deque()
        finished = False
        try:
            with uninterrupted():
                executor = ProcessPoolExecutor(
                    self.n,
                    mp_context=fork_server_context(),
                    initializer=_init_pool_worker,
                    initargs=(setup, main_alive),
                )
            # A bounded window of tasks in flight: memory stays constant however large the corpus.
            for task in tasks:
                with uninterrupted():  # a submit may start a worker process
                    pending.append((task, executor.submit(fn, task)))
                if len(pending) > 2 * self.n:
                    t, fut = pending.popleft()
                    yield t, fut.result()
            while pending:
                t, fut = pending.popleft()
                yield t, fut.result()
            finished = True
        finally:
            with uninterrupted():
                # No future is cancelled here: the pool, broken by the workers' end, fails each one it
                # still holds, and in Python 3.11 it raises on one found cancelled.
                if executor is not None:
                    if finished:
                        executor.shutdown(wait=True)
                    else:  # an error, a signal, or the caller is done: stop them at once
                        _terminate(executor)
                        _shutdown_within(executor, SHUTDOWN_S)
                main_alive.close()
                keep_alive.close()


SHUTDOWN_S = 10.0  # how long a stopped pool gets to wind down before this process goes on without it


STUCK_POOL: list[bool] = []  # a pool whose shutdown did not finish: the exit must not wait for it


def _shutdown_within(executor: ProcessPoolExecutor, seconds: float) -> None:
    """Shut down a pool whose workers were just terminated, waiting at most `seconds`: a worker
    terminated while this process's queue feeder writes a task to it can leave the pool's manager
    thread waiting forever (CPython gh-94777). The workers themselves are gone either way; a pool
    left stuck is noted in STUCK_POOL, for the command to exit without joining it."""
    done = threading.Thread(target=executor.shutdown, kwargs={"wait": True}, daemon=True)
    done.start()
    done.join(seconds)
    if done.is_alive():
        STUCK_POOL.append(True)
    for p in list((getattr(executor, "_processes", None) or {}).values()):
        with contextlib.suppress(OSError, ValueError, AssertionError):
            p.join(max(0.0, seconds - 1))
            if p.is_alive():
                p.kill()


def _terminate(executor: ProcessPoolExecutor) -> None:
    """Stop the pool's workers now, not after their current task (shutdown then reaps them)."""
    stop = getattr(executor, "terminate_workers", None)  # Python 3.14
    if stop is not None:
        stop()
        return
    # The queue's feeder thread may be writing a task to a worker about to die: the pool's shutdown
    # must not wait for it (its join_thread), or it waits forever (CPython gh-94777).
    call_queue = getattr(executor, "_call_queue", None)
    if call_queue is not None:
        call_queue.cancel_join_thread()
    workers = list((getattr(executor, "_processes", None) or {}).values())
    for p in workers:
        with contextlib.suppress(OSError, ValueError):
            p.terminate()
    for p in workers:
        with contextlib.suppress(OSError, ValueError, AssertionError):
            p.join(SHUTDOWN_S)
    # A worker terminated while sending its result leaves part of a message in the result pipe, and the
    # pool's manager thread reading it waits for the rest forever. With every worker gone, closing this
    # process's own write end gives that read an end of file: the pool sees itself broken and winds down.
    result_queue = getattr(executor, "_result_queue", None)
    with contextlib.suppress(AttributeError, OSError):
        result_queue._writer.close()  # type: ignore[union-attr]


def fork_server_context(
    *preload: str,
) -> multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext:
    """Not fork: the caller may hold threads (a process group, a prefetching loader). A fork
    server that has imported this module (and `preload`, the tasks' own modules) the first time it
    starts begins each process in milliseconds, for every prepare of this process; spawn where
    there is none."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, *preload])
    if threading.current_thread() is threading.main_thread():
        # Started with SIGINT ignored, the fork server and every process it forks inherit that from
        # birth: a Ctrl-C to the process group while one is still starting is the main process's alone.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            forkserver.ensure_running()
        finally:
            signal.signal(signal.SIGINT, previous)
    return ctx


def _init_pool_worker(setup: Setup, main_alive: multiprocessing.connection.Connection) -> None:
    """A worker process: Ctrl-C at a terminal (sent to the whole process group) is the main
    process's to handle, and the worker ends when the main process is gone, even by kill -9."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=exit_with_main, args=(main_alive,), daemon=True).start()
    init_worker(setup)


def exit_with_main(main_alive: multiprocessing.connection.Connection) -> None:
    """Only the main process holds the pipe's other end: end of file means it is gone."""
    with contextlib.suppress(EOFError, OSError):
        main_alive.recv_bytes()
    os._exit(1)

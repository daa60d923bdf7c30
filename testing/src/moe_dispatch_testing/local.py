"""Local ranks: a pool of gloo processes on this machine, reused across many tasks.

Rendezvous goes through a file (no listening socket) and gloo's pairs connect over the
loopback interface only. Each worker keeps its process group for the pool's lifetime, so
a test suite or the demo pays the start-up (process spawn, ``import torch``) once.

Workers are forked from multiprocessing's fork server with torch imported there once
(``set_forkserver_preload``): a pool starts in ~0.2 s instead of ~2 s of ``import torch``
per process, which matters to a suite that needs a fresh pool after every failure. The
server is a clean single-threaded process (no CUDA, no thread pools), so forking it is safe;
each worker takes the environment of the process that made the pool, not the server's.
Where there is no fork server (Windows), workers are spawned.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import tempfile
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Outcome:
    """One rank's result of a task: its value, or the exception it raised."""

    rank: int
    ok: bool
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""


class RanksFailed(Exception):
    """Some ranks raised; ``outcomes`` has every rank's result or error."""

    def __init__(self, outcomes: list[Outcome]) -> None:
        self.outcomes = outcomes
        failed = [o for o in outcomes if not o.ok]
        detail = "\n".join(f"--- rank {o.rank} ---\n{o.traceback.rstrip()}" for o in failed)
        super().__init__(f"{len(failed)} of {len(outcomes)} ranks failed:\n{detail}")

    @property
    def errors(self) -> dict[int, BaseException | None]:
        return {o.rank: o.error for o in self.outcomes if not o.ok}


class RanksTimedOut(Exception):
    """Some ranks did not answer within the timeout; the pool was shut down."""


def _context() -> Any:
    """A fork server with torch imported (see the module docstring), else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])  # read when the server starts: the first pool
    return ctx


def _worker(rank: int, world_size: int, store_path: str, timeout_s: float, threads: int, conn: Connection,
            environ: dict[str, str]) -> None:
    # The pool maker's environment, as a spawned process would have it (the fork server's dates from its start).
    os.environ.clear()
    os.environ.update(environ)
    # This is our own child process: pin gloo to loopback before it creates its device.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        while True:
            try:
                task = conn.recv()
            except EOFError:
                break
            except Exception as exc:  # noqa: BLE001 - a task this process cannot unpickle: say why, keep serving
                conn.send(("err", None, RuntimeError(f"rank {rank} could not load the task ({type(exc).__name__}: "
                                                     f"{exc}); fn and its arguments must be importable by name"),
                           traceback.format_exc()))
                continue
            if task is None:
                break
            fn, args, kwargs = task
            try:
                value = fn(rank, world_size, *args, **kwargs)
                conn.send(("ok", value, None, ""))
            except BaseException as exc:  # report, keep serving
                tb = traceback.format_exc()
                try:
                    conn.send(("err", None, exc, tb))
                except Exception:  # unpicklable exception
                    conn.send(("err", None, RuntimeError(f"{type(exc).__name__}: {exc}"), tb))
    finally:
        dist.destroy_process_group()


class RankPool:
    """``world_size`` gloo ranks as worker processes. ``map(fn, *args)`` runs
    ``fn(rank, world_size, *args)`` on every rank and returns the results in rank order.
    ``fn`` must be importable by name (a module-level function)."""

    def __init__(
        self, world_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S, threads_per_rank: int | None = None
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            from moe_dispatch import InvalidSpecError

            raise InvalidSpecError("must be the number of local ranks", parameter="world_size", value=world_size,
                                   allowed="an int >= 1")
        self.world_size = world_size
        self.timeout_s = timeout_s
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        self._dir = tempfile.TemporaryDirectory(prefix="moe-dispatch-ranks-")
        store = os.path.join(self._dir.name, "store")
        ctx = _context()
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        #: False once a task failed on some rank: its process group may be mid-collective.
        self.healthy = True
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker, args=(rank, world_size, store, timeout_s, threads, child, dict(os.environ)),
                daemon=True
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def try_map(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Outcome]:
        """Run ``fn`` on every rank; every rank's outcome, errors included."""
        _check_spawnable(fn)
        if not self.alive:
            raise RanksTimedOut("the rank pool is closed or a worker died; create a new pool")
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        deadline = timeout_s if timeout_s is not None else self.timeout_s + 30.0
        pending = dict(enumerate(self._conns))
        outcomes: dict[int, Outcome] = {}
        import time

        end = time.monotonic() + deadline
        while pending:
            ready = wait(list(pending.values()), timeout=max(0.0, end - time.monotonic()))
            if not ready:
                missing = sorted(pending)
                self.close(force=True)
                raise RanksTimedOut(f"ranks {missing} did not finish {fn.__name__} within {deadline:.0f} s")
            for rank, conn in list(pending.items()):
                if conn in ready:
                    try:
                        status, value, error, tb = conn.recv()
                    except (EOFError, OSError):  # the worker died (closed or reset pipe)
                        self._procs[rank].join(timeout=5)
                        code = self._procs[rank].exitcode
                        status, value, error, tb = "err", None, RuntimeError(f"rank {rank} died"), f"exit code {code}"
                    outcomes[rank] = Outcome(rank, status == "ok", value, error, tb)
                    del pending[rank]
        if not all(o.ok for o in outcomes.values()):
            self.healthy = False
        return [outcomes[r] for r in range(self.world_size)]

    def map(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn`` on every rank; the values in rank order, or ``RanksFailed``."""
        outcomes = self.try_map(fn, *args, timeout_s=timeout_s, **kwargs)
        if not all(o.ok for o in outcomes):
            raise RanksFailed(outcomes)
        return [o.value for o in outcomes]

    def close(self, force: bool = False) -> None:
        for conn, proc in zip(self._conns, self._procs):
            if not force and proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self._procs:
            proc.join(timeout=0 if force else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self._dir.cleanup()

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_spawnable(fn: Callable[..., Any]) -> None:
    """The spawned ranks find ``fn`` by name: one defined in a ``__main__`` without a file (``python -c``,
    stdin, a notebook) cannot be found there, and the rank would only exit with status 1."""
    import sys

    from moe_dispatch import InvalidSpecError

    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise InvalidSpecError(
            "is defined where the spawned ranks cannot import it (an interactive session, python -c or stdin)",
            parameter="fn", value=getattr(fn, "__qualname__", fn),
            allowed="a module-level function of a file: a module, or a script run as python script.py")


def one_rank_group(backend: str, env: "dict[str, str] | os._Environ[str]" = os.environ) -> bool:
    """Start this process's default process group on ``backend`` unless one is running: the
    launch's when torchrun set ``RANK`` (``env://``), else a group of one through a file store
    (no listening socket). Returns whether it started one, so the caller knows to destroy it.
    What a one-device hardware check needs: vendor libraries take a process group even alone."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if "RANK" in env:
        dist.init_process_group(backend)
        return True
    store = os.path.join(tempfile.mkdtemp(prefix="moe_dispatch_one_rank_"), "store")
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    return True


def run_local(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Start ``world_size`` local gloo ranks (processes on this machine, bound to the loopback
    interface, rendezvous through a file), run ``fn(rank, world_size, *args, **kwargs)`` on each
    with ``torch.distributed`` initialized, stop them and return the results in rank order.

    Public: what the demo, the examples and the tests use, for a script or a test of your own
    (``RankPool`` keeps the ranks for many calls). The ranks are spawned, so ``fn`` is found by
    name: a module-level function of a file (a script's own functions work, with the script's
    work under ``if __name__ == "__main__":``; code from ``python -c``, stdin or a notebook does
    not), its arguments and result picklable. A rank that raises makes ``RanksFailed`` with every
    rank's traceback; ranks that do not answer within ``DEFAULT_TIMEOUT_S`` (120 s, also the
    process group's timeout), ``RanksTimedOut``."""
    _check_spawnable(fn)  # before spawning anything
    with RankPool(world_size) as pool:
        return pool.map(fn, *args, **kwargs)


__all__ = ["Outcome", "RankPool", "RanksFailed", "RanksTimedOut", "one_rank_group", "run_local"]

"""Compiled CPU code called from many threads, and after ``os.fork``.

Threads. A kernel is stateless: any number of threads may call it at once (each calling thread gets
TVM's thread pool of its own: TVM keeps one per thread that launches parallel work, and a workspace
per thread). A Relax VM is not: it keeps registers and frames per call, so an imported model takes a
VM from `Pool` for each run, one per concurrent caller, all over the same executable and weights
(the VM reads a CPU executable's constants in place: nothing is copied per VM). The calls release
the GIL (TVM-FFI's default).

Fork. A forked child has only the thread that forked, and that thread's pool structures (TVM's, or
libgomp's for `compiler.openmp` kernels) still name the parent's workers, which the child does not
have: a parallel launch there waits for them forever. So in a child:

- TVM's pool: where the forking thread had launched work, calls from that thread run on a fresh
  thread of the child (`_after_fork_thread`), whose pool TVM starts anew; every other thread of the
  child is fresh already. The kernel keeps all its threads.
- OpenMP (libgomp) cannot be restarted: the forking thread's team is set to one thread before its
  first call in the child, with one warning, as PyTorch's DataLoader workers do (torch's own ops in
  that thread would hang otherwise too).

Spawned children import everything anew and need nothing.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import threading
from typing import Any, Callable, Generic, TypeVar

LOG = logging.getLogger("tvmattn")

_local = threading.local()  # per thread: .tvm / .openmp = this thread has launched on that pool
_stale_tvm: int | None = None  # the thread (ident) whose TVM pool a fork left without workers
_stale_openmp: int | None = None  # the same for libgomp's team
_fresh: concurrent.futures.ThreadPoolExecutor | None = None  # the child's thread for `_stale_tvm`'s calls
_lock = threading.Lock()  # guards `Pool`s and `_fresh`; held across a fork, so a child never inherits it taken
_serial = threading.RLock()  # `one_at_a_time`'s; held across a fork too


def run_on_tvm_pool(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, compiled CPU code that may start TVM's thread pool."""
    if threading.get_ident() == _stale_tvm:
        return _after_fork_thread().submit(fn, *args).result()
    _local.tvm = True
    return fn(*args)


def run_on_openmp(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, a kernel whose parallel loops run on this process's OpenMP threads."""
    global _stale_openmp
    if threading.get_ident() == _stale_openmp:
        _stale_openmp = None
        _one_openmp_thread()
    _local.openmp = True
    return fn(*args)


T = TypeVar("T")


def one_at_a_time(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` while no other such call runs: TVM's library export (`export_library`, an object file
    written for the emulation harness) aborted the process when two threads ran it at once."""
    with _serial:
        return fn(*args)


def once(owner: Any, name: str, make: Callable[[], T]) -> T:
    """``owner``'s attribute ``name``, made by ``make()`` on first use (`one_at_a_time`; threads that ask
    meanwhile wait for it: none is made twice, as a ``cached_property`` may from Python 3.12)."""
    made = owner.__dict__.get(name)
    if made is None:
        with _serial:
            made = owner.__dict__.get(name)
            if made is None:
                made = owner.__dict__[name] = make()
    return made


class Pool(Generic[T]):
    """Objects made on demand (``make()``), each used by one caller at a time: as many as calls ever
    ran at once, reused after."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make, self._idle = make, []

    def take(self) -> T:
        with _lock:
            if self._idle:
                return self._idle.pop()
        return self._make()

    def give_back(self, item: T) -> None:
        with _lock:
            self._idle.append(item)


def _after_fork_thread() -> concurrent.futures.ThreadPoolExecutor:
    global _fresh
    with _lock:
        if _fresh is None:
            _fresh = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tvmattn-after-fork")
        return _fresh


def _one_openmp_thread() -> None:
    try:
        ctypes.CDLL(None).omp_set_num_threads(1)
    except AttributeError:  # no OpenMP runtime loaded: nothing to set
        return
    LOG.warning("tvmattn: this process was forked after running kernels on OpenMP threads, which a child "
                "cannot restart: this thread now runs them (and torch's ops) on one thread, as PyTorch's "
                "DataLoader workers do; use the 'spawn' start method to keep every thread")


def _before_fork() -> None:
    _serial.acquire()
    _lock.acquire()


def _after_fork_in_parent() -> None:
    _lock.release()
    _serial.release()


def _after_fork_in_child() -> None:
    global _stale_tvm, _stale_openmp, _fresh, _lock, _serial
    _lock, _serial = threading.Lock(), threading.RLock()
    me = threading.get_ident()
    if getattr(_local, "tvm", False) or _stale_tvm == me:
        _stale_tvm = me
    if getattr(_local, "openmp", False) or _stale_openmp == me:
        _stale_openmp = me
    _fresh = None  # its thread is the parent's


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)

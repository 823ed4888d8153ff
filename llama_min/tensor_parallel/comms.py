"""The collectives of tensor parallelism: Communicator (the interface), FakeGroup / FakeCommunicator
(in one process, one thread a rank: the CPU's, or one GPU's), NcclCommunicator (CuPy's NCCL, one
GPU a rank) and NCCL_ENV, the environment set before NCCL initialises (NCCL_NVLS_ENABLE=0)."""

from __future__ import annotations

import os
import threading

import numpy as np

from llama_min.tensor_parallel.sharding import _xp_of

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}     # no NVLink SHARP / multicast, ever (set before NCCL initialises)


class Communicator:
    """The collectives of one rank of a group of `size`. Arrays are the rank's (NumPy, or CuPy on
    its device); the GPU ones run on the current stream, so they can be captured in a graph."""

    rank: int = 0
    size: int = 1

    def all_reduce_sum(self, x):
        """x (C-contiguous) := the elementwise sum of every rank's x, in place; returns x. Every
        rank gets the same bits."""
        raise NotImplementedError

    def all_gather(self, x):
        """-> a new [size, *x.shape] array: every rank's x, in rank order."""
        raise NotImplementedError

    def barrier(self):
        """Returns once every rank has called it (GPU: and the current stream's work is done)."""
        raise NotImplementedError

    def close(self):
        """Release what the communicator holds; idempotent."""


class FakeGroup:
    """N FakeCommunicators in one process exchanging arrays (NumPy; or CuPy arrays of one GPU, for
    single-GPU tests of the GPU step without NCCL), one thread a rank (each collective waits for
    every rank). Sums run in rank order 0..N-1 on every rank, so results are
    reproducible and equal on every rank. `calls` counts collectives by kind (rank 0's), `bytes`
    the bytes rank 0 contributed; abort() breaks every waiting rank out (BrokenBarrierError)."""

    def __init__(self, size: int, timeout: float = 120.0):
        if size < 1:
            raise ValueError(f"group size must be >= 1, got {size}")
        self.size = int(size)
        self._barrier = threading.Barrier(self.size, timeout=timeout)
        self._slots = [None] * self.size
        self.calls = {"all_reduce": 0, "all_gather": 0, "barrier": 0}
        self.bytes = {"all_reduce": 0, "all_gather": 0}
        self.communicators = [FakeCommunicator(self, r) for r in range(self.size)]

    def __getitem__(self, rank) -> "FakeCommunicator":
        return self.communicators[rank]

    def __len__(self):
        return self.size

    def abort(self):
        self._barrier.abort()

    def reset(self):
        self._barrier.reset()

    def _exchange(self, rank, x, kind):
        self._slots[rank] = x.copy()
        if rank == 0:
            self.calls[kind] += 1
            self.bytes[kind] += self._slots[0].nbytes
        self._barrier.wait()
        got = list(self._slots)
        self._barrier.wait()                 # every rank has read the slots before they are reused
        return got


class FakeCommunicator(Communicator):
    """One rank of a FakeGroup (the CPU's communicator; NumPy arrays, or CuPy arrays of one device)."""

    def __init__(self, group: FakeGroup, rank: int):
        self.group, self.rank, self.size = group, rank, group.size

    def all_reduce_sum(self, x):
        parts = self.group._exchange(self.rank, x, "all_reduce")
        total = parts[0].copy()
        for p in parts[1:]:                  # rank order: the same bits on every rank
            total += p
        x[...] = total
        return x

    def all_gather(self, x):
        return _xp_of(x).stack(self.group._exchange(self.rank, x, "all_gather"))

    def barrier(self):
        if self.rank == 0:
            self.group.calls["barrier"] += 1
        self.group._barrier.wait()


def _nccl_environment():
    """NCCL_ENV into os.environ unless set (before the first communicator initialises NCCL);
    refuses NVLS turned on explicitly."""
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)
    if os.environ.get("NCCL_NVLS_ENABLE") != "0":
        raise RuntimeError(f"NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']!r}: llama_min's tensor parallelism "
                           "never uses NVLink multicast (NVLS); unset it or set it to 0")


class NcclCommunicator(Communicator):
    """One rank on one GPU through CuPy's NCCL binding (cupy.cuda.nccl.NcclCommunicator).

        comms = NcclCommunicator.create_all([0, 1, 2, 3])     # one process, one thread a GPU

    or, one process (or thread) a rank: uid = NcclCommunicator.unique_id() on rank 0, shared, then
    NcclCommunicator.from_unique_id(size, uid, rank, device). Collectives run on the current
    stream (capturable in a CUDA graph) on float32 / float16 / float64 / int32 arrays; in-place
    all-reduce. NCCL_NVLS_ENABLE=0 is set before NCCL initialises (module docstring)."""

    def __init__(self, comm, rank: int, size: int, device: int):
        self.comm, self.rank, self.size, self.device = comm, int(rank), int(size), int(device)
        self._flag = None

    @staticmethod
    def _nccl():
        _nccl_environment()
        from cupy.cuda import nccl
        if not nccl.available:
            raise RuntimeError("CuPy was built without NCCL (cupy.cuda.nccl.available is False)")
        return nccl

    @classmethod
    def create_all(cls, devices) -> list["NcclCommunicator"]:
        """Communicators of every device of this process (ncclCommInitAll); rank i on devices[i]."""
        nccl = cls._nccl()
        devices = [int(d) for d in devices]
        comms = nccl.NcclCommunicator.initAll(devices)
        return [cls(c, i, len(devices), d) for i, (c, d) in enumerate(zip(comms, devices))]

    @classmethod
    def unique_id(cls):
        return cls._nccl().get_unique_id()

    @classmethod
    def from_unique_id(cls, size: int, uid, rank: int, device: int) -> "NcclCommunicator":
        """Rank `rank` of `size` on `device` (ncclCommInitRank: blocks until every rank has joined,
        so call it from the rank's own thread or process)."""
        import cupy
        nccl = cls._nccl()
        with cupy.cuda.Device(device):
            return cls(nccl.NcclCommunicator(size, uid, rank), rank, size, device)

    def _dtype(self, x):
        nccl = self._nccl()
        table = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float16): nccl.NCCL_FLOAT16,
                 np.dtype(np.float64): nccl.NCCL_FLOAT64, np.dtype(np.int32): nccl.NCCL_INT32}
        try:
            return table[np.dtype(x.dtype)]
        except KeyError:
            raise TypeError(f"NCCL collectives here take {sorted(str(k) for k in table)}, got {x.dtype}") from None

    def _check(self, x):
        import cupy
        if not isinstance(x, cupy.ndarray) or not x.flags.c_contiguous or x.device.id != self.device:
            raise ValueError(f"rank {self.rank}: a C-contiguous CuPy array on device {self.device} is needed, got "
                             f"{type(x).__name__} on device {getattr(getattr(x, 'device', None), 'id', '?')}")

    def all_reduce_sum(self, x):
        import cupy
        self._check(x)
        nccl = self._nccl()
        stream = cupy.cuda.get_current_stream()
        self.comm.allReduce(x.data.ptr, x.data.ptr, x.size, self._dtype(x), nccl.NCCL_SUM, stream.ptr)
        return x

    def all_gather(self, x):
        import cupy
        self._check(x)
        out = cupy.empty((self.size,) + x.shape, x.dtype)
        stream = cupy.cuda.get_current_stream()
        self.comm.allGather(x.data.ptr, out.data.ptr, x.size, self._dtype(x), stream.ptr)
        return out

    def barrier(self):
        import cupy
        with cupy.cuda.Device(self.device):
            if self._flag is None:
                self._flag = cupy.zeros((1,), cupy.float32)
            self.all_reduce_sum(self._flag)
            cupy.cuda.get_current_stream().synchronize()

    def close(self):
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None

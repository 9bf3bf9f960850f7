"""NVMe swap files: the ZeRO-Infinity tier, with plain files and threads (chapter 7).

DeepSpeed's NVMe offload needs libaio; ours uses ordinary positioned I/O
(``os.pread`` / ``os.pwrite`` straight into tensor memory). Both calls release
the GIL, so a small thread pool gives asynchronous reads and writes that
overlap with the CPU optimizer step.

    MappedFile(dir, nbytes) a SwapFile mapped into memory (stage 3's parameter
                            shard): the kernel pages units in when they are
                            gathered (``willneed`` = read-ahead) and we hand
                            the pages back afterwards (``release``)
    SwapFile(dir, nbytes)   one file per rank and tier, created, *unlinked at
                            once* (the open descriptor keeps the data alive, so
                            nothing is left behind even if the rank is killed),
                            and its blocks reserved with posix_fallocate: a full
                            disk fails here, at initialize, not mid-training
    ChunkStore(...)         fixed-size chunks (one per unit) in a SwapFile,
                            streamed through ``buffer_count`` staging buffers:
                            read-ahead, step, write-behind

Buffered I/O goes through the page cache; after each write we advise the
kernel to write the pages back and drop them (POSIX_FADV_DONTNEED), so the
state really leaves RAM. A directory on tmpfs/ramfs *is* RAM: we warn.
"""
from __future__ import annotations

import errno
import mmap
import os
import tempfile
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from zerolab.config import ConfigError

ALIGN = 4096  # chunk offsets in the file: page-aligned
RAM_FILESYSTEMS = ("tmpfs", "ramfs", "devtmpfs")


class NVMeError(OSError):
    """An NVMe read/write/allocation failed (``.errno`` as the OS reported it)."""


def filesystem_type(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/mounts; "" if unknown)."""
    path, best, kind = os.path.realpath(path), "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def check_nvme_path(nvme_path, key: str) -> str:
    """A usable directory, or a ConfigError / NVMeError that names the config key."""
    if not nvme_path:
        raise ConfigError(f"{key}.nvme_path is missing; give a directory on the NVMe drive")
    path = os.fspath(nvme_path)
    if not os.path.exists(path):
        raise ConfigError(f"{key}.nvme_path {path!r} does not exist; create the directory on the NVMe drive first")
    if not os.path.isdir(path):
        raise ConfigError(f"{key}.nvme_path {path!r} is not a directory")
    if filesystem_type(path) in RAM_FILESYSTEMS:
        warnings.warn(f"{key}.nvme_path {path!r} is on {filesystem_type(path)}: that is RAM, not a disk, so "
                      f"'offload to NVMe' saves no memory there", stacklevel=3)
    return path


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class SwapFile:
    """``nbytes`` reserved in an unlinked file under ``directory``; positioned reads and writes."""

    def __init__(self, directory: str, nbytes: int, tag: str = "state", key: str = "offload"):
        self.nbytes, self.fd = nbytes, -1
        try:
            fd, name = tempfile.mkstemp(prefix=f"zerolab-{tag}-", suffix=".swp", dir=directory)
        except OSError as e:
            raise NVMeError(e.errno, f"{key}.nvme_path {directory!r}: cannot create a swap file there "
                                     f"({e.strerror}); the directory must be writable") from e
        os.unlink(name)  # from now on only the descriptor holds the file: killed rank -> nothing left behind
        self.fd = fd
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            self.close()
            why = "the disk is full" if e.errno == errno.ENOSPC else e.strerror
            raise NVMeError(e.errno, f"{key}.nvme_path {directory!r}: cannot reserve {nbytes / 1e6:.1f} MB for "
                                     f"the {tag} swap file ({why}); nothing was written, training state is "
                                     f"untouched") from e

    def read(self, t: torch.Tensor, offset: int) -> None:
        """Fill contiguous CPU tensor ``t`` from the file at byte ``offset``."""
        mv, done = _bytes_of(t), 0
        while done < len(mv):
            n = os.preadv(self.fd, [mv[done:]], offset + done)
            if n == 0:
                raise NVMeError(errno.EIO, f"short read from the swap file at byte {offset + done}")
            done += n

    def write(self, t: torch.Tensor, offset: int) -> None:
        mv, done = _bytes_of(t), 0
        while done < len(mv):
            done += os.pwrite(self.fd, mv[done:], offset + done)
        if hasattr(os, "posix_fadvise"):  # start write-back, drop clean pages: the data leaves RAM
            os.posix_fadvise(self.fd, offset, len(mv), os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        self.close()


class ChunkStore:
    """Chunks of fp32 (or any dtype) elements in a SwapFile, streamed through ``buffer_count`` buffers.

    ``stream(order)`` yields ``(i, buffer)`` with chunk i's data; the caller updates the buffer in
    place; when the caller moves on, the buffer is written back asynchronously. Reads run ahead
    into free buffers. A failed write keeps that chunk's data in RAM (``self.dirty``) and is
    reported by ``stream``'s ``errors`` list, so a step always completes consistently.
    """

    def __init__(self, directory, sizes, dtype=torch.float32, buffer_count=4, tag="state", key="offload",
                 pin=False):
        self.sizes, self.dtype = list(sizes), dtype
        esize = torch.empty((), dtype=dtype).element_size()
        self.offsets, off = [], 0
        for n in self.sizes:
            self.offsets.append(off)
            off += -(-n * esize // ALIGN) * ALIGN
        self.directory = directory
        self.file = SwapFile(directory, off, tag, key)
        self.buffer_count = max(1, int(buffer_count))
        big = max(self.sizes, default=0)
        # staging: buffer_count x largest chunk, the only resident copies of the state
        self.buffers = [torch.empty(big, dtype=dtype, pin_memory=pin) for _ in range(self.buffer_count)]
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"zerolab-{tag}-io")
        self.dirty: dict = {}       # chunk -> tensor whose write failed (held in RAM until written)
        self.errors: list = []      # OSErrors of failed writes in the last stream

    def nbytes(self) -> int:
        """Bytes of state on disk (the chunks themselves, without alignment padding)."""
        esize = torch.empty((), dtype=self.dtype).element_size()
        return sum(self.sizes) * esize

    def staging_bytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in self.buffers) + \
            sum(t.untyped_storage().nbytes() for t in self.dirty.values())

    def _read(self, i, buf):
        if i in self.dirty:
            buf.copy_(self.dirty[i])
        else:
            self.file.read(buf, self.offsets[i])
        return buf

    def _write(self, i, buf):
        try:
            self.file.write(buf, self.offsets[i])
            self.dirty.pop(i, None)
        except OSError as e:
            self.dirty[i] = buf.clone()  # keep the new state: the step stays whole
            self.errors.append((i, e))

    def write_now(self, i: int, t: torch.Tensor) -> None:
        """Synchronous write of chunk i (initialisation)."""
        self.file.write(t.contiguous(), self.offsets[i])

    def read_now(self, i: int) -> torch.Tensor:
        """A fresh tensor with chunk i (state dicts)."""
        out = torch.empty(self.sizes[i], dtype=self.dtype)
        return self._read(i, out)

    def stream(self, order):
        """Yield (i, chunk buffer) for i in order: read-ahead into free buffers, write-behind."""
        order, self.errors = list(order), []
        free = deque(self.buffers)
        reads, writes = deque(), deque()   # (i, full buffer, chunk view, future), (full buffer, future)
        nxt = 0

        def read_next():
            nonlocal nxt
            if not free:  # every buffer busy: wait for the oldest write-behind
                full, fut = writes.popleft()
                fut.result()
                free.append(full)
            full = free.popleft()
            i = order[nxt]
            view = full[: self.sizes[i]]
            reads.append((i, full, view, self.pool.submit(self._read, i, view)))
            nxt += 1

        try:
            for i in order:
                if not reads:
                    read_next()
                while nxt < len(order) and (free or (writes and writes[0][1].done())):  # read ahead
                    read_next()
                j, full, view, fut = reads.popleft()
                assert j == i
                fut.result()
                yield i, view
                writes.append((full, self.pool.submit(self._write, i, view)))
        finally:
            for _, fut in writes:
                fut.result()
            for _, _, _, fut in reads:
                fut.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.file.close()


class MappedFile:
    """A SwapFile mapped with MAP_SHARED: a tensor whose pages live on disk until touched."""

    def __init__(self, directory: str, nbytes: int, tag: str = "params", key: str = "offload"):
        self.file = SwapFile(directory, max(nbytes, 1), tag, key)
        self.directory, self.nbytes = directory, nbytes
        self.map = mmap.mmap(self.file.fd, max(nbytes, 1), flags=mmap.MAP_SHARED)

    def tensor(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """(numel,) tensor over the mapping (its storage is the file)."""
        return torch.frombuffer(self.map, dtype=dtype, count=numel)

    def _pages(self, start: int, end: int):
        a = start // mmap.PAGESIZE * mmap.PAGESIZE
        return a, min(-(-end // mmap.PAGESIZE) * mmap.PAGESIZE, len(self.map)) - a

    def willneed(self, start: int, end: int) -> None:
        """Ask the kernel to read bytes [start, end) ahead, asynchronously (prefetch)."""
        a, n = self._pages(start, end)
        if n > 0:
            self.map.madvise(mmap.MADV_WILLNEED, a, n)

    def release(self, start: int = 0, end: int | None = None) -> None:
        """Write bytes [start, end) back and drop their pages from this process (RSS goes down)."""
        a, n = self._pages(start, self.nbytes if end is None else end)
        if n > 0:
            self.map.flush(a, n)
            self.map.madvise(mmap.MADV_DONTNEED, a, n)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.file.fd, a, n, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a tensor still views the mapping: the kernel unmaps it at exit
            pass
        self.file.close()

"""What one decode step costs the host: a `TorchDispatchMode` that counts dispatched ops, bytes of fresh tensors, and
the ops that would stall the host on an accelerator (a device→host read), for benchmarks/worker_step.py.

On a CPU every tensor is a host tensor, so "would sync on CUDA" needs to know which tensors would live on the device.
The rule here: a tensor is device-side unless it is one of SGLang's host-side tensors handed in as `host` (e.g.
`seq_lens_cpu`) or is computed only from host-side tensors, or comes from a factory call that names no device
(`torch.arange(n)`, `torch.tensor(list)`; SGLang and our worker name the device for every device tensor). A sync is
counted when an op reads a device-side value on the host: `_local_scalar_dense` (`.item()`, `int(t)`, `bool(t)`),
`nonzero`, `masked_select`, `unique`, `repeat_interleave` without `output_size`, `equal`, indexing or index-writing
with a boolean mask (it hides a nonzero), a blocking copy into a host-side tensor, and `Tensor.tolist` / `.cpu()`
(they reach no dispatcher op on a CPU tensor, so they are wrapped while counting). `.to(device)` of a host tensor
is not seen on a CPU (no op), so a value moved to the device and read back later counts only if something else made
it device-side.
Not counted: the bounds check `F.one_hot(x, n)` runs on a CPU only. Counted apart (`standin`): reads inside
dspark_sgl/sglang/cpu/, the pure-torch stand-ins for sgl_kernel's CUDA ops (on CUDA those are kernels).
"""

from __future__ import annotations

import linecache
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten
READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten.equal.default,
         aten.is_nonzero.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default}
INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
COPIES = {aten.copy_.default}
TORCH_DIR = str(Path(torch.__file__).parent)
HERE = str(Path(__file__).resolve())
STANDINS = "/dspark_sgl/sglang/cpu/"  # the CPU stand-ins for SGLang's CUDA kernels (sgl_kernel ops)


def _caller():
    """The first frame outside torch and this file that led to the current op."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH_DIR) or frame.f_code.co_filename == HERE):
        frame = frame.f_back
    return frame


def _site() -> str:
    frame = _caller()
    return "?" if frame is None else f"{'/'.join(Path(frame.f_code.co_filename).parts[-2:])}:{frame.f_lineno}"


def _call_text() -> str:
    """Source text of the call outside torch and this file that led to the current op (its whole span)."""
    frame = _caller()
    if frame is None:
        return ""
    positions = list(frame.f_code.co_positions())
    start, end = positions[frame.f_lasti // 2][:2] if frame.f_lasti // 2 < len(positions) else (None, None)
    start = start or frame.f_lineno
    end = max(end or start, start)
    return "".join(linecache.getline(frame.f_code.co_filename, n) for n in range(start, end + 1))


class StepCounter(TorchDispatchMode):
    """Counts over the `with` block: ops, fresh bytes, and syncs by kind (see the module docstring), apart for the
    target model's forward (`in_section("target")`) and everything else the step runs (`worker`)."""

    def __init__(self, host: list[torch.Tensor] = ()):
        super().__init__()
        self.host = WeakIdKeyDictionary()
        for t in host:
            if isinstance(t, torch.Tensor):
                self.host[t] = True
        self.section = "worker"
        self.ops: Counter = Counter()
        self.bytes: Counter = Counter()
        self.syncs: dict[str, Counter] = {"worker": Counter(), "target": Counter(), "standin": Counter()}
        self.sites: Counter = Counter()  # where the worker's syncs are called from (file:line)

    @contextmanager
    def in_section(self, name: str):
        outer, self.section = self.section, name
        try:
            yield
        finally:
            self.section = outer

    def _count(self, kind: str) -> None:
        section = self.section
        frame = _caller()
        if section == "worker" and frame is not None and STANDINS in frame.f_code.co_filename:
            section = "standin"  # a pure-torch stand-in for an sgl_kernel CUDA op: no host read on CUDA
        self.syncs[section][kind] += 1
        if section == "worker":
            self.sites[f"{kind} @ {_site()}"] += 1

    def is_host(self, t: torch.Tensor) -> bool:
        return t in self.host

    def _is_sync(self, func, args, kwargs, tensors) -> bool:
        device_in = any(not self.is_host(t) for t in tensors)
        if func in READS:
            # F.one_hot(x, n) checks x.min() >= 0 on a CPU only (CUDA relies on a device assert): not a CUDA sync
            return device_in and not (func is aten._local_scalar_dense.default and "one_hot(" in _call_text())
        if func is aten.repeat_interleave.Tensor:
            return kwargs.get("output_size") is None and device_in
        if func in INDEXING:
            idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
            return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) and not self.is_host(i)
                       for i in idx)
        if func in COPIES:  # a blocking copy into a host tensor (non_blocking=True into pinned memory does not wait)
            return self.is_host(args[0]) and not self.is_host(args[1]) and not kwargs.get("non_blocking", False)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self.ops[self.section] += 1
        if self._is_sync(func, args, kwargs, tensors):
            self._count(func.__name__)
        out = func(*args, **kwargs)
        host = all(self.is_host(t) for t in tensors) if tensors else "device" not in _call_text()
        if func is aten.lift_fresh.default:  # torch.tensor(data[, device=...]): the call decides
            host = "device" not in _call_text()
        for i, arg in enumerate(func._schema.arguments):  # in-place writes: the written tensor joins its inputs' side
            if arg.alias_info is not None and arg.alias_info.is_write:
                target = args[i] if i < len(args) else kwargs.get(arg.name)
                if isinstance(target, torch.Tensor) and not host:
                    self.host.pop(target, None)
        fresh = all(r.alias_info is None for r in func._schema.returns)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                if host:
                    self.host[t] = True
                if fresh:
                    self.bytes[self.section] += t.untyped_storage().nbytes()
        return out

    @contextmanager
    def wrapped_reads(self):
        """`tolist` and `.cpu()` of a device-side tensor are syncs on CUDA; on a CPU tensor they dispatch nothing."""
        tolist, cpu = torch.Tensor.tolist, torch.Tensor.cpu
        counter = self

        def counted_tolist(t, *a, **k):
            if not counter.is_host(t):
                counter._count("tolist")
            return tolist(t, *a, **k)

        def counted_cpu(t, *a, **k):
            if not counter.is_host(t):
                counter._count("cpu")
            out = cpu(t, *a, **k)
            if out is not t:  # on a CPU tensor .cpu() is the tensor itself: it stays device-side
                counter.host[out] = True
            return out

        torch.Tensor.tolist, torch.Tensor.cpu = counted_tolist, counted_cpu
        try:
            yield self
        finally:
            torch.Tensor.tolist, torch.Tensor.cpu = tolist, cpu

    def num_syncs(self, section: str = "worker") -> int:
        return sum(self.syncs[section].values())

"""Device-to-host copies that never make the model's CUDA stream wait.

For the CUDA tensors of a call, the streaming writer's thread

1. makes a side stream (one per device, non-blocking: it never synchronises with the legacy
   default stream the model usually runs on) current, so that delta storage's byte comparisons
   (:class:`iobundle.calls.DeltaIndex`) and the copies run there;
2. copies each tensor (the new part only, for an extension) into a **pinned** host buffer with
   ``non_blocking=True`` and waits for an event recorded after the copies: the writer thread
   waits, the model's stream does not;
3. gives the pinned buffers back once the file is written, for the next call (pinning is slow;
   reusing the buffers is what makes the copy run at the bus's speed).

The writer process's hand-off (:meth:`PinnedStager.to_pinned`) packs a call's CUDA tensors into
one buffer per device and copies it to pinned memory without waiting; the bytes reach the shared
ring when the call's message is sent (:meth:`PinnedStager.land`). The copies read snapshots made
on the model's stream (so the model may change its tensors meanwhile). CPU tensors pass through.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

from iobundle._lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


__all__ = ["Packed", "PinnedStager", "buffer_size"]


class Packed(NamedTuple):
    """The bytes of one device's tensors of a call, on their way to pinned memory (:meth:`PinnedStager.to_pinned`)."""

    event: torch.cuda.Event
    buffer: torch.Tensor
    places: list[tuple[int, int, int]]  # (offset in the call's range, bytes, position in the buffer)
    packed: torch.Tensor  # the device copy, alive until the copy to the host is done


def buffer_size(nbytes: int) -> int:
    """A recycled buffer's size for ``nbytes``: one of 8 sizes per power of two (at most 12.5% slack), 4 KiB aligned."""
    step = max(4096, 1 << max(nbytes.bit_length() - 4, 0))
    return -(-nbytes // step) * step


class PinnedStager:
    """Pinned host buffers and a side stream per device, for the writer thread's D2H copies.

    At most ``keep_bytes`` of free pinned memory is kept between calls (the largest call staged so far).
    """

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._sizes: list[int] = []
        self._free: list[torch.Tensor] = []
        self._free_bytes = 0
        self.keep_bytes = 0
        self._lock = threading.Lock()

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream

    @contextlib.contextmanager
    def side_streams(self, tensors: list[torch.Tensor]) -> Iterator[None]:
        """Make each CUDA device's side stream current (this thread only) for the block."""
        with contextlib.ExitStack() as stack:
            for device in {t.device for t in tensors if t.device.type == "cuda"}:
                stack.enter_context(torch.cuda.stream(self.stream(device)))
            yield

    def _take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            i = bisect.bisect_left(self._sizes, nbytes)
            if i < len(self._sizes) and self._sizes[i] <= 2 * nbytes:
                del self._sizes[i]
                self._free_bytes -= self._free[i].numel()
                return self._free.pop(i)
        with torch.inference_mode(False):  # reused by later calls, maybe outside inference_mode
            return torch.empty(buffer_size(nbytes), dtype=torch.uint8, pin_memory=True)

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        """Return the pinned buffers of :meth:`to_host` (their bytes are written); keep what fits."""
        with self._lock:
            self.keep_bytes = max(self.keep_bytes, sum(b.numel() for b in buffers))
            for buf in sorted(buffers, key=lambda b: b.numel()):
                if self._free_bytes + buf.numel() > self.keep_bytes:
                    break
                i = bisect.bisect_left(self._sizes, buf.numel())
                self._sizes.insert(i, buf.numel())
                self._free.insert(i, buf)
                self._free_bytes += buf.numel()

    def to_pinned(self, items: list[tuple[torch.Tensor, int, int]]) -> list[Packed]:
        """Queue one packed copy per device of the contiguous CUDA tensors ``items`` into pinned memory.

        ``items`` are ``(tensor, offset, nbytes)``: where each tensor's bytes go in the call's range.
        Per device the tensors are concatenated as bytes on the side stream (one kernel), after the
        events their snapshots recorded (or the current stream), then copied to a pinned buffer with
        ``non_blocking=True``: nothing waits here, neither this thread nor the model's stream.
        :meth:`land` waits for the copies and moves the bytes to where they go.
        """
        by_device: dict[torch.device, list[tuple[torch.Tensor, int, int]]] = {}
        for item in items:
            by_device.setdefault(item[0].device, []).append(item)
        packed = []
        for device, group in by_device.items():
            stream = self.stream(device)
            for t, _, _ in group:
                ready = getattr(t, "_iobundle_ready", None)
                if ready is not None:
                    stream.wait_event(ready)
                else:
                    stream.wait_stream(torch.cuda.current_stream(device))
            total = sum(n for _, _, n in group)
            buf = self._take(total)
            with torch.cuda.stream(stream):
                flat = torch.cat([t.reshape(-1).view(torch.uint8) for t, _, _ in group])
                buf[:total].copy_(flat, non_blocking=True)
                for t, _, _ in group:
                    t.record_stream(stream)
                event = torch.cuda.Event()
                event.record(stream)
            places, position = [], 0
            for _, offset, nbytes in group:
                places.append((offset, nbytes, position))
                position += nbytes
            packed.append(Packed(event, buf, places, flat))
        return packed

    def land(self, packed: list[Packed], base: int) -> None:
        """Wait for the copies of :meth:`to_pinned`, then copy each tensor's bytes to ``base + offset``."""
        for item in packed:
            item.event.synchronize()  # this thread waits; the model's stream never does
            start = item.buffer.data_ptr()
            for offset, nbytes, position in item.places:
                ctypes.memmove(base + offset, start + position, nbytes)
        self.give_back([item.buffer for item in packed])

    def to_host(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """CPU copies of the CUDA tensors of ``tensors`` (others as they are), and the pinned buffers used.

        Every copy is queued on its device's side stream, then this thread waits for all of them at once.
        """
        out: dict[str, torch.Tensor] = {}
        buffers: list[torch.Tensor] = []
        events: list[torch.cuda.Event] = []
        used: dict[int, torch.cuda.Stream] = {}
        for key, t in tensors.items():
            if (
                t.device.type != "cuda"
                or t.numel() == 0
                or t.layout != torch.strided
                or t.is_quantized
                or t.is_nested
                or type(t) is not torch.Tensor
            ):
                out[key] = t  # tensor_bytes copies it (or refuses it with a clear error)
                continue
            stream = self.stream(t.device)
            nbytes = t.numel() * t.element_size()
            buf = self._take(nbytes)
            buffers.append(buf)
            with torch.cuda.stream(stream):
                src = t.detach()
                if not src.is_contiguous():
                    src = src.contiguous()  # on the side stream
                dst = buf[:nbytes].view(t.dtype).view(t.shape)
                dst.copy_(src, non_blocking=True)
                t.record_stream(stream)
                src.record_stream(stream)
            used[id(stream)] = stream
            out[key] = dst
        for stream in used.values():
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        for event in events:
            event.synchronize()  # the writer thread waits; the model's stream never does
        return out, buffers

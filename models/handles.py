"""Objects a compiled graph reaches by handle.

An opaque op in a compiled graph (decodelab::host_attend, decodelab::onednn_linear) needs
a host-side object (a step's booked plan, a packed weight) that is no tensor. It gets a
handle instead: an int64 CPU tensor, a graph input rather than a constant (an int would be
specialized and guarded on, so every object would compile its own graph), which the op
looks up here. Held weakly: a dropped object frees what it holds, and its handle then
finds nothing (handles are never reused).
"""

from __future__ import annotations

import itertools
import weakref

import torch


class Handles:
    """A weak registry of live objects by handle."""

    def __init__(self):
        self._live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._next = itertools.count()

    def add(self, obj) -> torch.Tensor:
        """A new handle of `obj`: a 0-d int64 tensor on the CPU (whatever device is the
        default while the object is built, e.g. a model built on the meta device)."""
        h = next(self._next)
        self._live[h] = obj
        return torch.tensor(h, device="cpu")

    def get(self, handle: torch.Tensor):
        """The live object of `handle`, or None."""
        return self._live.get(int(handle))

"""What the engine's loader reads from safetensors files, recorded for tests.

reads = record_reads(monkeypatch)
load_target(path)
reads.names     # the tensors read (whole or in part), in order
reads.elements  # the elements of each read: a whole tensor's, or a slice's
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.models import common


@dataclass
class Reads:
    names: list[str] = field(default_factory=list)
    elements: list[int] = field(default_factory=list)

    def clear(self) -> None:
        self.names.clear()
        self.elements.clear()


def record_reads(monkeypatch) -> Reads:
    """Wrap engine.models.common.safe_open (for this test) to record every tensor read."""
    reads = Reads()
    real_open = common.safe_open

    class Recording:
        def __init__(self, *args, **kwargs) -> None:
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            tensor = self.inner.get_tensor(name)
            reads.names.append(name)
            reads.elements.append(tensor.numel())
            return tensor

        def get_slice(self, name):
            inner = self.inner.get_slice(name)

            class Piece:
                def __getitem__(self, index):
                    part = inner[index]
                    reads.names.append(name)
                    reads.elements.append(part.numel())
                    return part

            return Piece()

    monkeypatch.setattr(common, "safe_open", Recording)
    return reads

"""The torch driver's jobs: what its rank processes time. Shared by the parent
side (:mod:`.torch_driver`) and the rank processes (:mod:`.torch_rank`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from ..model import OPS

__all__ = ["BACKENDS", "Job", "MODULE_VARIANT", "TARGETS"]

#: The variant of the rows timed through ``MoeEpLayer`` (the torch.nn.Module).
MODULE_VARIANT = "MoeEpLayer"

#: Backends timed in the torch driver's rank processes, and what each times.
BACKENDS: Dict[str, Tuple[str, ...]] = {"torch": OPS, "cuda-nccl": ("forward", "forward_backward")}
TARGETS = tuple(BACKENDS) + ("all_to_all", "copy", "grouped_gemm", "weight_read")


@dataclass(frozen=True)
class Job:
    """One measurement in the rank processes."""

    id: int
    target: str
    op: str
    tokens: int
    format: str
    #: timed through moe_ep_torch.module.MoeEpLayer (forward_backward of a backend)
    module: bool = False

    @property
    def phase(self) -> str:
        """The weights the job needs in memory: GEMM baselines run on bf16 weights."""
        return "bf16" if self.target in ("grouped_gemm", "weight_read") else self.format

    def describe(self) -> str:
        if self.target == "weight_read":
            return "weight_read (device copy of the local bf16 weights)"
        via = f" ({MODULE_VARIANT})" if self.module else ""
        return f"{self.target}{via} {self.op} {self.format} T={self.tokens}"

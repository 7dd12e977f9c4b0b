"""The memory plan beside what the GPUs measured: the numbers to calibrate it with.

A CUDA pool keeps its launch's plan in WorkerPool.status() (`plan_status`, MiB per rank) and,
after its first job, each rank's measured CUDA peak beside it (`record_measured`), logging
one line with both (`measured_line`).
"""
from __future__ import annotations

from typing import Optional

from comfyui_xdit.planning.launch_policy import UnplannedLaunch
from comfyui_xdit.planning.memory_arithmetic import RESERVE_BYTES, MemoryPlan

MiB = 2 ** 20


def plan_status(plan: Optional[MemoryPlan], mode: str) -> dict:
    """The plan as WorkerPool.status() shows it (MiB per rank), with room for the measured
    peaks `record_measured` adds after the first job: the numbers to calibrate it with."""
    out = {"mode": mode, "predicted_mb_per_rank": None, "measured_peak_mb": None}
    if plan is None:
        return out
    if isinstance(plan, UnplannedLaunch):
        return dict(out, error=plan.summary(), fits=None)
    out.update(predicted_mb_per_rank=[round(r.total / MiB) for r in plan.ranks],
               gpu_mb_per_rank=[None if r.gpu_memory is None else round(r.gpu_memory / MiB)
                                for r in plan.ranks],
               reserve_mb=round(RESERVE_BYTES / MiB), fits=plan.fits and not plan.misfits,
               job=None if plan.job is None else
               f"{plan.job.height}x{plan.job.width} batch {plan.job.batch}")
    return out


def measured_peaks(stats, world: int) -> Optional[tuple]:
    """A job's per-rank stats (workers/runtime/worker.py: `cuda_peak_mb`, `cuda_reserved_peak_mb`)
    -> (allocated MiB per rank, reserved MiB per rank), None where a rank did not say; None
    when no rank reported a CUDA peak (a CPU pool)."""
    alloc, reserved = [None] * world, [None] * world
    for i, st in enumerate(stats or []):
        r = st.get("rank", i) if isinstance(st, dict) else i
        if isinstance(st, dict) and 0 <= r < world:
            alloc[r] = st.get("cuda_peak_mb")
            reserved[r] = st.get("cuda_reserved_peak_mb")
    if all(a is None for a in alloc):
        return None
    return alloc, reserved


def measured_line(predicted_mb, measured_mb, reserved_mb=None,
                  reserve_mb: float = RESERVE_BYTES / MiB) -> str:
    """One log line: the plan's per-rank prediction beside the measured CUDA peaks. torch's
    allocator sees neither the CUDA context nor NCCL's buffers, which the plan's reserve
    stands for, so the ratio is taken against the prediction without the reserve."""
    def row(values, fmt="{:.0f}"):
        return "/".join("?" if v is None else fmt.format(v) for v in values)
    bare = [p - reserve_mb for p in predicted_mb]
    ratio = [None if m is None or b <= 0 else m / b for m, b in zip(measured_mb, bare)]
    line = (f"xDiT memory plan vs the first job, MiB on ranks "
            f"{row(range(len(predicted_mb)))}: predicted {row(predicted_mb)} ({row(bare)} "
            f"without the {reserve_mb:.0f} MiB CUDA reserve); measured peak allocated "
            f"{row(measured_mb)} ({row(ratio, '{:.2f}')}x the prediction without reserve)")
    if reserved_mb is not None and any(v is not None for v in reserved_mb):
        line += f", reserved {row(reserved_mb)}"
    return line


def record_measured(status: dict, stats, world: int) -> Optional[str]:
    """After a job on a CUDA pool: the first measured peaks into `status` (plan_status's
    dict) and the line to log; None when there is nothing new (already measured, no
    prediction, no CUDA peak in the stats)."""
    if status.get("measured_peak_mb") is not None or not status.get("predicted_mb_per_rank"):
        return None
    peaks = measured_peaks(stats, world)
    if peaks is None:
        return None
    status["measured_peak_mb"] = [None if v is None else round(v) for v in peaks[0]]
    if any(v is not None for v in peaks[1]):
        status["measured_reserved_mb"] = [None if v is None else round(v) for v in peaks[1]]
    return measured_line(status["predicted_mb_per_rank"], peaks[0], peaks[1],
                         status.get("reserve_mb", RESERVE_BYTES / MiB))

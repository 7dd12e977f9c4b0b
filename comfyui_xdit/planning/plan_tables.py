"""The memory-plan command's markdown tables, each a comparison over GPU counts: every
method's peak rank against GPU sizes (`compare_table`), shard_weights' bytes and all-gather
traffic (`shard_table`), and each method's bytes sent per denoising step (`traffic_table`),
timed on the links of memory_arithmetic.LINKS_GBPS or the user's. The README and docs show
their output.
"""
from __future__ import annotations

import dataclasses

from comfyui_xdit.planning.config import EngineOptions, ParallelConfig
from comfyui_xdit.planning.memory_arithmetic import (DTYPE_BYTES, GiB, LINKS_GBPS, JobSize, gib,
                                                     plan, quantised_bytes, shard_figures,
                                                     step_traffic)
from comfyui_xdit.planning.model_facts import ModelFacts, transformer_facts


def compare_table(facts: ModelFacts, job: JobSize, dtype: str, counts, sizes_gib,
                  gguf=()) -> str:
    """Markdown: rows = method x text-encoder placement (x fp8 where it changes a verdict,
    x each of `gguf`'s (type, bytes per value): the model as a GGUF file of that type),
    columns = GPU count x GPU size; a cell is the peak rank's GiB and the verdict."""
    tr = transformer_facts(facts.transformer_class, facts.transformer_config, facts.arch)

    def seq(n):  # Ulysses where the heads split evenly, else Ring: the same memory
        return ParallelConfig(ulysses=n) if tr.heads % n == 0 else ParallelConfig(ring=n)
    methods = [("Ulysses/Ring {n} (replicated)", seq, False),
               ("PipeFusion {n}", lambda n: ParallelConfig(pipefusion=n), False),
               ("shard_weights, Ulysses/Ring {n}", seq, True)]
    cols = [(n, g) for g in sizes_gib for n in counts]
    head = ["method", "text enc.", "weights"] + [f"{n}x{g:g} GB" for n, g in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, make, shard in methods:
        for te in ("gpu", "cpu"):
            rows = {}
            kinds = [("full", "full", facts), ("fp8", "fp8", facts)] + [
                (name, "auto", dataclasses.replace(facts, gguf_bytes_per_value=bpv))
                for name, bpv in gguf]
            for kind, weights, f in kinds:
                cells = []
                for n, g in cols:
                    if make(n).pipefusion > len(tr.blocks):
                        cells.append((None, None))
                        continue
                    e = EngineOptions(device="cuda", dtype=dtype, weights=weights,
                                      text_encoders=te, shard_weights=shard)
                    p = plan(f, make(n), e, job, int(g * GiB), alternatives=False)
                    cells.append((p.worst.total, p.fits))
                rows[kind] = cells
            for kind, _, _ in kinds:
                if kind == "fp8" and [f for _, f in rows["fp8"]] == \
                        [f for _, f in rows["full"]]:
                    continue  # fp8 changes no verdict: not shown
                cells = ["-" if t is None else f"{t / GiB:.1f} {'✓' if f else '✗'}"
                         for t, f in rows[kind]]
                lines.append("| " + " | ".join([label.format(n="N"), te,
                                                dtype if kind == "full" else kind]
                                               + cells) + " |")
    return "\n".join(lines)


def shard_table(facts: ModelFacts, dtype: str, weights: str, counts, links=LINKS_GBPS) -> str:
    """Markdown: shard_weights' bytes per rank and all-gather traffic per forward on each GPU
    count (one forward a step; two with CFG in one process), timed on `links`."""
    tr = transformer_facts(facts.transformer_class, facts.transformer_config, facts.arch)
    fp8 = quantised_bytes(facts, weights)
    head = ["ranks", "weights at rest", "peak in a forward", "received per forward"] + \
        [f"{name} ~{bw:g} GB/s" for name, bw in links]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in counts:
        f = shard_figures(tr, DTYPE_BYTES[dtype], fp8, n)
        lines.append("| " + " | ".join(
            [str(n), gib(f.at_rest), gib(f.peak), gib(f.received_per_forward)] +
            [f"{f.received_per_forward / (bw * 1e9) * 1e3:.0f} ms" for _, bw in links]) + " |")
    return "\n".join(lines)



def _ms(ms: float) -> str:
    return f"{ms:,.0f} ms" if ms >= 10 else f"{ms:.2g} ms"


def traffic_table(facts: ModelFacts, job: JobSize, dtype: str, counts,
                  links=LINKS_GBPS) -> str:
    """Markdown: step_traffic per method and degree, GB (1e9 B) a rank sends per step, and
    that volume's time on `links` (a floor: the schedules overlap some of it with compute)."""
    tr = transformer_facts(facts.transformer_class, facts.transformer_config, facts.arch)
    head = ["method", "ranks", "sent per rank per step"] + \
        [f"{name} ~{bw:g} GB/s" for name, bw in links]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = []
    for name in ("Ulysses", "Ring", "PipeFusion", "shard_weights"):
        for n in counts:
            if n < 2 or (name == "Ulysses" and tr.heads % n) or \
                    (name == "PipeFusion" and n > len(tr.blocks)):
                continue
            rows.append((name, n, step_traffic(facts, job, dtype, n)[name]))
    if job.cfg:
        rows.append(("CFG parallel", 2, step_traffic(facts, job, dtype, 2)["CFG parallel"]))
    for name, n, b in rows:
        lines.append("| " + " | ".join([name, str(n), f"{b / 1e9:.3g} GB"] + [
            _ms(b / (bw * 1e9) * 1e3) for _, bw in links]) + " |")
    return "\n".join(lines)

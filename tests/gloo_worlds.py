"""Run a test's attention cases on real gloo ranks: for each world size, fork that many ranks
(after importing once, before any torch compute), give each its process group and run
`cases(rank, world, ulysses, ring, report)` for every (ulysses, ring) layout of that world;
each rank writes its `report` dict as JSON, which the test then reads.

The ranks run in a child process of the test (`python <test file> launch DIR`), so a hang or
crash there fails one fixture instead of the pytest process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _rank_main(rank, world, store, layouts, out, cases):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    report = {}
    for ulysses, ring in layouts:
        cases(rank, world, ulysses, ring, report)
    Path(f"{out}.{rank}").write_text(json.dumps(report))
    dist.destroy_process_group()


def launch(workdir, worlds: dict, cases) -> None:
    """The child's side: {world: [(ulysses, ring), ...]}; exits non-zero if a rank fails."""
    import multiprocessing as mp

    import yunchang  # noqa: F401
    import workers.parallel.attention  # noqa: F401
    import workers.parallel.topology  # noqa: F401

    ctx = mp.get_context("fork")
    deadline = time.monotonic() + 240
    for world, layouts in worlds.items():
        store = os.path.join(workdir, f"store{world}")
        out = os.path.join(workdir, f"report{world}")
        procs = [ctx.Process(target=_rank_main, args=(r, world, store, layouts, out, cases),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        codes = [p.exitcode for p in procs]
        if codes != [0] * world:
            sys.exit(f"world {world}: rank exit codes {codes}")


def reports(test_file, workdir, worlds: dict) -> dict:
    """The test's side: run `test_file launch workdir` and read {world: [rank's report]}."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(test_file), "launch", str(workdir)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {world: [json.loads(Path(workdir, f"report{world}.{r}").read_text())
                    for r in range(world)] for world in worlds}

"""A worker's launch: what it imports before its first job, the launch breakdown in the
pool's status, and the checkpoint prefetch (workers/loading/prefetch.py) that overlaps the
imports without changing a loaded byte."""
from __future__ import annotations

import os
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from comfyui_xdit import GenerationRequest, ParallelConfig, WorkerPool
from single_file_util import write_single_file
from test_conditioning import encode
from workers.loading import prefetch as P
from workers.loading.weights import Checkpoint

HOOK = "xdit_testhooks.probes:modules_at_first_job"
JOB = dict(seed=3, steps=1, height=64, width=64, max_sequence_length=8)
# what a rank without text encoders never needs before (or for) a conditioning job
TEXT_MODULES = ("transformers.models.t5.modeling_t5", "transformers.models.clip.modeling_clip")


def _deferred(seen):
    return [m for m in seen if m in TEXT_MODULES or m.startswith("diffusers.pipelines.")]


def _transformer_bytes(path) -> int:
    return sum(os.path.getsize(p) for p in P.checkpoint_paths(str(path)))


def _check_breakdown(ranks, files_bytes, host_ready_s, prefetched=True):
    for r in ranks:
        parts = [r[k] for k in ("start_s", "import_s", "setup_s", "load_s", "ready_s")]
        assert all(v >= 0 for v in parts), r
        assert r["import_s"] <= r["setup_s"], r  # the import floor is part of the setup
        assert r["start_s"] + r["setup_s"] + r["load_s"] <= r["ready_s"] + 1e-6, r
        assert r["ready_s"] <= host_ready_s + 0.5, (r, host_ready_s)  # tick resolution
        pf = r["prefetch"]
        if not prefetched and pf["state"].startswith("off ("):  # `auto` on a small machine
            assert pf["bytes"] == 0, pf
            continue
        assert pf["state"] == "done" and pf["bytes"] == pf["of_bytes"] == files_bytes, pf
        assert 0 <= pf["s"] <= r["ready_s"], pf


def test_folder_pool_defers_text_modules_and_reports_its_launch(model_dir, monkeypatch):
    """Two ranks on a folder, a ComfyUI-conditioning job: rank 1 (no text encoders) has no
    text-encoder model or pipeline module imported when its first job starts; rank 0 (which
    holds the encoders) has, so the watch does see them. The status carries each rank's
    launch breakdown, consistent with itself and the host's clock, and the first job's time."""
    folder = model_dir("flux")
    pos = encode("flux", str(folder), "a red cube", JOB["max_sequence_length"])
    monkeypatch.setenv(P.ENV, "on")  # the CI machine has 2 cores: `auto` leaves it off
    with WorkerPool(folder, ParallelConfig(ulysses=2), device="cpu", threads_per_rank=1,
                    worker_hooks=[HOOK]) as pool:
        res = pool.generate(GenerationRequest(prompt=[], positive=pos, guidance=4.0, **JOB))
        seen = {st["rank"]: st["hooks"][HOOK]["at_first_job"] for st in res.stats}
        assert _deferred(seen[1]) == [], seen[1]
        assert set(TEXT_MODULES) <= set(seen[0])  # negative control: rank 0 loaded T5/CLIP
        _check_breakdown(pool.last_launch["ranks"], _transformer_bytes(folder),
                         pool.last_launch["ready_s"])
        status = pool.status()
        _check_breakdown(status["ranks"], _transformer_bytes(folder),
                         pool.last_launch["ready_s"])
        for r in status["ranks"]:
            assert 0 < r["first_job_s"] <= res.timings["job_s"], r


def test_single_file_pool_imports_no_text_encoders(model_dir, tmp_path):
    """A single file (ComfyUI's diffusion_models: text always comes as conditioning): not
    even rank 0 imports a text encoder or pipeline before its first job."""
    folder = model_dir("flux")
    path = write_single_file(folder, "flux", tmp_path / "flux1-tiny.safetensors")
    pos = encode("flux", str(folder), "a red cube", JOB["max_sequence_length"])
    with WorkerPool(path, ParallelConfig(), device="cpu", threads_per_rank=1,
                    worker_hooks=[HOOK]) as pool:
        res = pool.generate(GenerationRequest(prompt=[], positive=pos, guidance=4.0, **JOB))
        assert _deferred(res.stats[0]["hooks"][HOOK]["at_first_job"]) == []
        _check_breakdown(pool.status()["ranks"], os.path.getsize(path),
                         pool.last_launch["ready_s"], prefetched=P._cores() >= 2)


def _files(tmp_path, sizes):
    out = []
    for i, n in enumerate(sizes):
        p = tmp_path / f"part{i}.bin"
        p.write_bytes(bytes(range(256)) * (n // 256) + bytes(n % 256))
        out.append(str(p))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_prefetch_reads_every_byte_once_from_its_rank_share(tmp_path, world):
    paths = _files(tmp_path, [10_000, 3_000, 7_001])
    total = 20_001
    for rank in range(world):
        p = P.Prefetch(paths, rank, world, chunk=1024)
        spans = p._spans()
        covered = {path: set() for path in paths}
        for path, a, b in spans:
            assert not covered[path] & set(range(a, b)), "a byte read twice"
            covered[path] |= set(range(a, b))
        assert all(covered[path] == set(range(os.path.getsize(path))) for path in paths)
        first = spans[0]
        start = sum(os.path.getsize(x) for x in paths[:paths.index(first[0])]) + first[1]
        assert start == (total * rank // world) // 1024 * 1024  # the rank's share, chunked
        p.start()
        p.stop()  # waits: the reader either finished or stopped between chunks
        assert p.report()["state"] in ("done", "stopped")
        q = P.Prefetch(paths, rank, world, chunk=1024)
        q.start()
        q._thread.join()
        assert q.report() | {"s": 0} == {"state": "done", "bytes": total, "of_bytes": total,
                                         "s": 0}


def test_prefetch_stops_between_chunks(tmp_path, monkeypatch):
    paths = _files(tmp_path, [64 * 1024])
    p = P.Prefetch(paths, chunk=1024)
    real = os.preadv

    def one_then_stop(fd, bufs, pos):
        p._stop.set()  # as `stop()` would, mid-read
        return real(fd, bufs, pos)

    monkeypatch.setattr(P.os, "preadv", one_then_stop)
    p.start()
    p._thread.join()
    assert p.report()["state"] == "stopped" and p.report()["bytes"] == 1024


def test_prefetch_off_where_a_rank_reads_part_or_asked(tmp_path, monkeypatch):
    paths = _files(tmp_path, [4096])
    args = types.SimpleNamespace(pipefusion=1, shard_weights=False, load_in_turn=False)
    monkeypatch.setattr(P, "_cores", lambda: 4)
    assert P.off_reason(args, paths, [4096], world=2) is None
    assert "4 cores for 3" in P.off_reason(args, paths, [4096], world=3)  # no spare core
    monkeypatch.setenv(P.ENV, "on")
    assert P.off_reason(args, paths, [4096], world=3) is None
    for change, word in ((dict(pipefusion=2), "part"), (dict(shard_weights=True), "part"),
                         (dict(load_in_turn=True), "in turn")):
        assert word in P.off_reason(types.SimpleNamespace(**{**vars(args), **change}),
                                    paths, [4096])
    assert "available memory" in P.off_reason(args, paths, [2 ** 62])
    monkeypatch.setenv(P.ENV, "off")
    assert "XDIT_PREFETCH" in P.off_reason(args, paths, [4096])


def test_prefetched_load_is_bit_identical(model_dir, tmp_path, monkeypatch):
    """The prefetch reads the checkpoint beside the load; the load's tensors are the file's,
    bit for bit, on both read paths (the CPU's map and the device path's positioned read)."""
    src = load_file(str(model_dir("flux") / "transformer" /
                        "diffusion_pytorch_model.safetensors"))
    path = str(tmp_path / "t.safetensors")
    save_file(src, path)
    args = types.SimpleNamespace(model=path, model_2=None, pipefusion=1, shard_weights=False,
                                 load_in_turn=False)
    monkeypatch.setenv(P.ENV, "on")
    p = P.Prefetch.for_worker(args, rank=1, world=2)
    assert p.reason is None
    with Checkpoint.open([path]) as ck:
        mapped = {k: ck.read(k, "cpu").clone() for k in ck.keys()}
        pread = {k: ck._pread(*ck._span(k), k).clone() for k in ck.keys()}
    p.stop()
    assert p.report()["state"] in ("done", "stopped")
    assert set(mapped) == set(src)
    for k, v in src.items():
        assert mapped[k].dtype == pread[k].dtype == v.dtype
        raw = v.reshape(-1).view(torch.uint8)
        assert torch.equal(mapped[k].reshape(-1).view(torch.uint8), raw)
        assert torch.equal(pread[k].reshape(-1).view(torch.uint8), raw)


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 26])
def test_staged_device_reads_are_bit_identical(model_dir, tmp_path, chunk):
    """The GPU read path (two reused buffers, chunks that split tensors anywhere, even
    inside an element), run here onto the CPU: every tensor is the file's, bit for bit,
    including 0-dim and empty ones."""
    from workers.loading.staging import Staging

    src = load_file(str(model_dir("flux") / "transformer" /
                        "diffusion_pytorch_model.safetensors"))
    src = dict(src, scalar=torch.tensor(2.5, dtype=torch.bfloat16),
               empty=torch.zeros(0, 3, dtype=torch.float16), flags=torch.tensor([True, False]))
    path = str(tmp_path / "t.safetensors")
    save_file(src, path)
    with Checkpoint.open([path]) as ck:
        st = Staging("cpu", chunk)
        got = {k: st.read(ck._handle(path, "fd"), *ck._span(k)[1:], path, k).clone()
               for k in ck.keys()}
        st.close()
        sized = ck.staging("cpu")  # the checkpoint's own: no larger than its largest tensor
        assert sized.chunk == max(v.numel() * v.element_size() for v in src.values())
    assert set(got) == set(src)
    for k, v in src.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))

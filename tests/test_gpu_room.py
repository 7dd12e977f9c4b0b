"""Room for the pool on its GPUs (comfyui_xdit/planning/room.py), against a stand-in for
ComfyUI's memory manager: `free_memory(bytes, device)` unloads the models of that device,
last loaded first, only while the device has less free memory than asked (ComfyUI's rule).

The nodes used to call `unload_all_models()` before every CUDA Sampler and Decode run: every
ComfyUI model on every GPU left, even with memory to spare, and was loaded again next run.
"""
from __future__ import annotations

import pytest

from comfyui_xdit import GenerationRequest, ParallelConfig
from comfyui_xdit.planning import gpus, launch_policy, room

GiB = 2 ** 30


class FakeModelManager:
    """ComfyUI's model manager as the pool meets it: models loaded per cuda index, the
    device's free memory, and free_memory's rule."""

    def __init__(self, free: dict, loaded: dict):
        self.free = dict(free)
        self.loaded = {d: list(ms) for d, ms in loaded.items()}
        self.asked: list = []
        self.unloaded: list = []

    def free_memory(self, need: int, index: int) -> None:
        self.asked.append((index, need))
        while self.free[index] <= need and self.loaded.get(index):
            name, size = self.loaded[index].pop()
            self.free[index] += size
            self.unloaded.append((index, name))


@pytest.fixture
def pool(model_dir, monkeypatch):
    """An unlaunched CUDA pool on GPUs 1 and 2 of four 80 GB GPUs."""
    from comfyui_xdit import WorkerPool
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setattr(gpus, "gpu_memory_bytes", lambda ids: [80 * GiB] * len(ids))
    p = WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cuda", dtype="bf16",
                   gpus=["1", "2"])
    yield p
    p.close()


REQ = GenerationRequest(prompt=["a cat"], steps=2, height=256, width=256)
LOADED = {0: [("clip", 1 * GiB)], 1: [("t5", 9 * GiB), ("vae", 1 * GiB)],
          2: [("other model", 20 * GiB)]}


def test_memory_to_spare_unloads_nothing(pool):
    mm = FakeModelManager({0: 1 * GiB, 1: 60 * GiB, 2: 50 * GiB}, LOADED)
    asked = room.make_room(pool, REQ, mm.free_memory)
    assert sorted(asked) == [1, 2]  # the pool's GPUs only, in ComfyUI's numbering
    assert [i for i, _ in mm.asked] == [1, 2]  # GPU 0 (nearly full) is never touched
    assert all(2 * GiB < n < 10 * GiB for n in asked.values()), asked  # reserve + tiny model
    assert mm.unloaded == []


def test_short_memory_frees_what_the_pool_needs_on_its_gpus_only(pool):
    mm = FakeModelManager({0: 0, 1: GiB // 2, 2: 50 * GiB}, LOADED)
    asked = room.make_room(pool, REQ, mm.free_memory)
    # GPU 1: the VAE (1 GiB) is not enough, the text encoder goes too; GPU 2 has room
    assert mm.unloaded == [(1, "vae"), (1, "t5")]
    assert mm.free[1] > asked[1]
    assert mm.loaded[0] == LOADED[0] and mm.loaded[2] == LOADED[2]


def test_a_running_pool_asks_only_for_what_the_job_adds(pool, monkeypatch):
    launch = room.room_needed(pool, REQ)
    monkeypatch.setattr(pool, "is_running", lambda: True)
    running = room.room_needed(pool, REQ)
    assert set(running) == set(launch)
    assert all(0 < running[i] < launch[i] for i in launch), (running, launch)
    bigger = room.room_needed(pool, GenerationRequest(prompt=["a cat"] * 4, steps=2,
                                                      height=1024, width=1024))
    assert all(bigger[i] > running[i] for i in running)


def test_ranks_sharing_a_gpu_add_up_and_cpu_asks_nothing(model_dir, monkeypatch):
    from comfyui_xdit import WorkerPool
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    monkeypatch.setattr(gpus, "gpu_memory_bytes", lambda ids: [80 * GiB] * len(ids))
    shared = WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cuda",
                        dtype="bf16", gpus=["1", "1"])
    alone = WorkerPool(model_dir("flux"), ParallelConfig(), device="cuda", dtype="bf16",
                       gpus=["1"])
    both, one = room.room_needed(shared, REQ), room.room_needed(alone, REQ)
    assert list(both) == [1] and list(one) == [1]  # physical GPU 5 is ComfyUI's cuda:1
    assert both[1] > one[1]
    cpu = WorkerPool(model_dir("flux"), ParallelConfig(), device="cpu")
    mm = FakeModelManager({0: 0}, {0: [("clip", GiB)]})
    assert room.make_room(cpu, REQ, mm.free_memory) == {} and mm.asked == []


def test_no_plan_asks_nothing(pool, monkeypatch, caplog):
    def broken(*a, **k):
        raise RuntimeError("unreadable")
    monkeypatch.setattr(launch_policy, "model_facts", broken)
    mm = FakeModelManager({1: 0, 2: 0}, LOADED)
    with caplog.at_level("WARNING", logger="comfyui_xdit"):
        assert room.make_room(pool, REQ, mm.free_memory) == {}
    assert mm.asked == [] and "not offloaded" in caplog.text


def test_the_sampler_node_asks_before_its_job(model_dir, monkeypatch):
    """nodes/operations.py's sample asks `free_memory` with the job's room once the
    registry has the pool, before the job runs."""
    from comfyui_xdit.nodes.handles import ModelHandle
    from comfyui_xdit.nodes.operations import SampleInputs, sample
    from comfyui_xdit.nodes.pool_registry import PoolRegistry

    order = []

    class Stop(Exception):
        pass

    class FakePool:
        def __init__(self, path, config, **kw):
            self.config = config

        def generate(self, req, **kw):
            order.append("generate")
            raise Stop()

    monkeypatch.setattr("comfyui_xdit.nodes.operations.make_room",
                        lambda pool, req, free: order.append(("room", req.height)) or {})
    monkeypatch.setattr("comfyui_xdit.nodes.operations.gpus_for_ranks", lambda n, g: ["0"] * n)
    handle = ModelHandle(path=str(model_dir("flux")), device="cuda", dtype="bf16",
                         world_size=1)
    import torch
    inp = SampleInputs(latent={"samples": torch.zeros(1, 16, 8, 8)}, prompt="a cat", seed=1,
                       steps=1)
    with pytest.raises(Stop):
        sample(handle, inp, registry=PoolRegistry(pool_factory=FakePool),
               free_memory=lambda n, i: None)
    assert order == [("room", 64), "generate"]

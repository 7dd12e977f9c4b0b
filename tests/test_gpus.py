"""GPU selection (comfyui_xdit/planning/gpus.py): which GPUs are visible, one GPU per rank, and one
clear error for a world size they cannot hold, raised before any worker process starts.
No GPU needed: the GPU count and CUDA_VISIBLE_DEVICES are faked."""
from __future__ import annotations

import subprocess

import pytest
import torch

from comfyui_xdit import ConfigError, GenerationRequest, ParallelConfig
from comfyui_xdit.planning import gpus
from comfyui_xdit.planning.gpus import describe_visible, gpus_for_ranks, parse_visible, visible_gpus
from comfyui_xdit.nodes.handles import ModelHandle
from comfyui_xdit.nodes.operations import SampleInputs, sample
from comfyui_xdit.nodes.pool_registry import PoolRegistry

ENV = "CUDA_VISIBLE_DEVICES"


@pytest.fixture
def fake_gpus(monkeypatch):
    """fake_gpus(count, env): `count` GPUs reported by torch; env None unsets the variable."""
    def set_(count=0, env=None):
        monkeypatch.setattr(gpus, "device_count", lambda: count)
        if env is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, env)
    return set_


# ---- visibility -----------------------------------------------------------------------------
def test_unset_means_every_gpu_torch_reports(fake_gpus):
    fake_gpus(3, None)
    assert visible_gpus() == ["0", "1", "2"]
    fake_gpus(0, None)
    assert visible_gpus() == []


def test_set_lists_are_kept_as_given_and_never_counted(fake_gpus, monkeypatch):
    def no_count():
        raise AssertionError("CUDA_VISIBLE_DEVICES set: the list is read, nothing is counted")
    fake_gpus(8, "")
    monkeypatch.setattr(gpus, "device_count", no_count)
    assert visible_gpus() == []  # set but empty: no GPU
    for env, want in [("0,1", ["0", "1"]), ("3, 1", ["3", "1"]), ("2,,", ["2"]),
                      ("GPU-8f0c2a1e-aaaa-bbbb-cccc-0123456789ab,MIG-4f1e/1/0",
                       ["GPU-8f0c2a1e-aaaa-bbbb-cccc-0123456789ab", "MIG-4f1e/1/0"]),
                      ("-1", []), ("1,-1,2", ["1"])]:  # CUDA stops at a negative index
        monkeypatch.setenv(ENV, env)
        assert visible_gpus() == want, env
        assert parse_visible(env) == want
    # explicit environments (a child's) are read the same way
    assert visible_gpus({ENV: "4,5"}) == ["4", "5"]
    assert visible_gpus({}, count=lambda: 2) == ["0", "1"]


def test_counting_does_not_initialise_cuda():
    gpus.device_count()
    assert not torch.cuda.is_initialized()


def test_describe_visible():
    assert describe_visible({ENV: "0,1"}) == "(CUDA_VISIBLE_DEVICES=0,1)"
    assert describe_visible({ENV: ""}) == "(CUDA_VISIBLE_DEVICES is empty)"
    assert describe_visible({}) == "(CUDA_VISIBLE_DEVICES unset: every GPU torch reports)"


# ---- one GPU per rank, or one line ------------------------------------------------------------
def test_one_gpu_per_rank_from_the_visible_set(fake_gpus):
    fake_gpus(4, None)
    assert gpus_for_ranks(2) == ["0", "1"]
    fake_gpus(0, "2,3,GPU-x")
    assert gpus_for_ranks(3) == ["2", "3", "GPU-x"]


def test_too_few_gpus_is_one_line_naming_both(fake_gpus):
    fake_gpus(8, "0,1")
    with pytest.raises(ConfigError) as e:
        gpus_for_ranks(4)
    msg = str(e.value)
    assert msg.startswith("4 ranks need 4 GPUs; 2 are visible (CUDA_VISIBLE_DEVICES=0,1)")
    assert "\n" not in msg and "lower the world size to 2" in msg
    fake_gpus(8, "")
    with pytest.raises(ConfigError, match=r"^2 ranks need 2 GPUs; no GPU is visible "
                                          r"\(CUDA_VISIBLE_DEVICES is empty\)"):
        gpus_for_ranks(2)
    fake_gpus(1, None)
    with pytest.raises(ConfigError, match=r"^2 ranks need 2 GPUs; 1 is visible "
                                          r"\(CUDA_VISIBLE_DEVICES unset"):
        gpus_for_ranks(2)
    fake_gpus(0, None)
    with pytest.raises(ConfigError, match=r"^1 rank needs 1 GPU; no GPU is visible"):
        gpus_for_ranks(1)


def test_the_loaders_gpu_list(fake_gpus):
    """Indices are this process's numbering (ComfyUI's cuda:N): under CUDA_VISIBLE_DEVICES
    they name its entries; UUIDs pass through; an entry may repeat (shared-GPU tests)."""
    fake_gpus(4, None)
    assert gpus_for_ranks(2, ["3", "1"]) == ["3", "1"]
    assert gpus_for_ranks(2, "0, 0") == ["0", "0"]
    assert gpus_for_ranks(1, ["2", "3"]) == ["2"]
    fake_gpus(0, "5,7")
    assert gpus_for_ranks(2, ["1", "0"]) == ["7", "5"]
    assert gpus_for_ranks(2, ["GPU-a", "1"]) == ["GPU-a", "7"]
    with pytest.raises(ConfigError, match=r"^4 ranks need 4 GPUs; the GPU list has 2 "
                                          r"\(gpus=0,1\)"):
        gpus_for_ranks(4, ["0", "1"])
    with pytest.raises(ConfigError, match=r"^GPU 2 of the GPU list \(gpus=0,2\) is not visible: "
                                          r"2 are visible \(CUDA_VISIBLE_DEVICES=5,7\); use "
                                          r"indices 0..1"):
        gpus_for_ranks(2, ["0", "2"])


# ---- before any process starts ----------------------------------------------------------------
@pytest.fixture
def no_spawn(monkeypatch):
    """Any worker process started is a failure."""
    started = []

    def popen(*a, **kw):
        started.append(a)
        raise AssertionError("a worker process was started")
    monkeypatch.setenv("XDIT_LAUNCHER", "spawn")  # each rank a Popen (not forked by the helper)
    monkeypatch.setattr(subprocess, "Popen", popen)
    return started


def _req():
    return GenerationRequest(prompt=["a cat"], seed=1, steps=1, height=64, width=64,
                             max_sequence_length=8)


def test_pool_with_more_ranks_than_gpus_starts_nothing(model_dir, fake_gpus, no_spawn):
    from comfyui_xdit import WorkerPool
    fake_gpus(8, "0")
    pool = WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cuda")
    try:
        with pytest.raises(ConfigError) as e:
            pool.generate(_req())
        assert str(e.value) == ("2 ranks need 2 GPUs; 1 is visible (CUDA_VISIBLE_DEVICES=0): "
                                "lower the world size to 1 or make more GPUs visible")
        with pytest.raises(ConfigError, match=r"^2 ranks need 2 GPUs; 1 is visible"):
            pool.decode(torch.zeros(1, 16, 8, 8))  # the other launching call
        with pytest.raises(ConfigError, match=r"^2 ranks need 2 GPUs; the GPU list has 1"):
            WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cuda",
                       gpus=["0"]).generate(_req())
        assert no_spawn == [] and pool.worker_pids() == [] and pool._tmp is None
    finally:
        pool.close()


def test_each_rank_gets_its_own_gpu(model_dir, fake_gpus, monkeypatch):
    """The spawned ranks' CUDA_VISIBLE_DEVICES: one visible GPU each, as given."""
    from comfyui_xdit import WorkerPool
    fake_gpus(0, "GPU-a,MIG-b/1/0,7")
    envs = []

    class Stop(Exception):
        pass

    def popen(cmd, env=None, **kw):
        envs.append(env)
        raise Stop
    monkeypatch.setenv("XDIT_LAUNCHER", "spawn")  # each rank a Popen (not forked by the helper)
    monkeypatch.setattr(subprocess, "Popen", popen)
    pool = WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cuda")
    with pytest.raises(Stop):
        pool.generate(_req())
    pool.close()
    assert [e[ENV] for e in envs] == ["GPU-a"]  # rank 0 is spawned first
    envs.clear()
    pool = WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cuda",
                      gpus=["2", "0"])
    with pytest.raises(Stop):
        pool.generate(_req())
    pool.close()
    assert [e[ENV] for e in envs] == ["7"]  # the list's index 2 of the visible set


def test_the_loader_and_the_sampler_check_first(model_dir, fake_gpus, no_spawn):
    fake_gpus(2, None)
    handle = ModelHandle(path=str(model_dir("flux")), device="cuda", dtype="bf16")
    assert handle.default_world() == 2
    assert ModelHandle(path=handle.path, device="cuda", gpus=("0", "0", "1")).default_world() == 3
    with pytest.raises(ConfigError, match=r"^4 ranks need 4 GPUs; 2 are visible "
                                          r"\(CUDA_VISIBLE_DEVICES unset"):
        ModelHandle(path=handle.path, device="cuda", world_size=4).validate()
    with pytest.raises(ConfigError, match=r"^4 ranks need 4 GPUs; 2 are visible"):
        ModelHandle(path=handle.path, device="cuda", ulysses=4).validate()
    ModelHandle(path=handle.path, device="cuda", ulysses=2).validate()
    fake_gpus(0, "")
    with pytest.raises(ConfigError, match=r"^1 rank needs 1 GPU; no GPU is visible "
                                          r"\(CUDA_VISIBLE_DEVICES is empty\)"):
        handle.validate()

    def factory(*a, **kw):
        raise AssertionError("the registry was asked for a pool")
    fake_gpus(0, "0")
    registry = PoolRegistry(pool_factory=factory)
    big = ModelHandle(path=handle.path, device="cuda", world_size=2)
    with pytest.raises(ConfigError, match=r"^2 ranks need 2 GPUs; 1 is visible "
                                          r"\(CUDA_VISIBLE_DEVICES=0\)"):
        sample(big, SampleInputs(latent={"samples": torch.zeros(1, 16, 8, 8)}, prompt="a cat",
                                 steps=1, max_sequence_length=8), registry=registry)
    assert registry.pools() == [] and no_spawn == []


# ---- text encoders on a GPU of their own ----------------------------------------------------
def test_text_encoder_gpu_placement(fake_gpus):
    """text_encoders=cuda:N names the N-th visible GPU: rank 0's own ("gpu"), another rank's,
    or a spare one; rank 0 is then given it as its second GPU (cuda:1)."""
    from comfyui_xdit.planning.gpus import TextEncoderGPU, text_encoder_gpu
    fake_gpus(0, "2,3,5")
    ranks = ["2", "3"]
    assert text_encoder_gpu("auto", ranks) is None and text_encoder_gpu("cpu", ranks) is None
    assert text_encoder_gpu("cuda:0", ranks) == TextEncoderGPU("2", 0, "2", "gpu")
    assert text_encoder_gpu("cuda:1", ranks) == TextEncoderGPU("3", 1, "2,3", "cuda:1")
    assert text_encoder_gpu("cuda:2", ranks) == TextEncoderGPU("5", None, "2,5", "cuda:1")
    with pytest.raises(ConfigError) as e:
        text_encoder_gpu("cuda:3", ranks)
    assert str(e.value) == ("text_encoders cuda:3: 3 are visible (CUDA_VISIBLE_DEVICES=2,3,5); "
                            "use cuda:0..cuda:2, gpu, auto or cpu")


def test_rank0_is_given_the_text_encoders_gpu(model_dir, fake_gpus, monkeypatch, no_spawn):
    """The spawned rank 0 sees its own GPU and the text encoders' one, and runs them on its
    cuda:1; a GPU that is not visible is refused before anything starts."""
    from comfyui_xdit import WorkerPool
    fake_gpus(0, "0,1,2")
    pool = WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cuda",
                      text_encoders="cuda:7")
    with pytest.raises(ConfigError, match=r"^text_encoders cuda:7: 3 are visible"):
        pool.generate(_req())
    assert no_spawn == [] and pool.worker_pids() == []
    pool.close()
    spawned = []

    class Stop(Exception):
        pass

    def popen(cmd, env=None, **kw):
        spawned.append((cmd, env))
        raise Stop
    monkeypatch.setenv("XDIT_LAUNCHER", "spawn")  # each rank a Popen (not forked by the helper)
    monkeypatch.setattr(subprocess, "Popen", popen)
    pool = WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cuda",
                      text_encoders="cuda:2")
    with pytest.raises(Stop):
        pool.generate(_req())
    pool.close()
    (cmd, env), = spawned  # rank 0 is spawned first
    assert env[ENV] == "0,2"
    assert cmd[cmd.index("--text-encoders") + 1] == "cuda:1"

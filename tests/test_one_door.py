"""One door to both planes: only workers/parallel/topology.py and workers/parallel/p2p.py call torch.distributed's
communication functions, so the plane check there sees every call; and the check itself.

The door test parses every module of workers/ (ast, not regex: aliases, `from` imports and
`getattr(dist, "...")` are followed); a self-test first proves the finder catches each form.
"""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from workers.parallel import topology

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOORS = {"workers/parallel/topology.py", "workers/parallel/p2p.py"}
COMM = {"all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_coalesced",
        "all_reduce", "all_reduce_coalesced", "all_to_all", "all_to_all_single", "broadcast",
        "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list",
        "reduce", "send", "recv", "isend", "irecv", "send_object_list", "recv_object_list",
        "batch_isend_irecv", "P2POp", "barrier", "monitored_barrier"}
# modules whose every function communicates (functional collectives and their autograd twins)
COMM_MODULES = {"torch.distributed._functional_collectives", "torch.distributed.nn",
                "torch.distributed.nn.functional"}
DIST_MODULES = {"torch.distributed", "torch.distributed.distributed_c10d"}


def _is_comm(name: str) -> bool:
    return name in COMM or name.startswith("reduce_scatter")


def comm_calls(source: str) -> list:
    """[(line, what)] for every reference to a torch.distributed communication function."""
    tree = ast.parse(source)
    dist_names = set()  # local names bound to torch.distributed (or its c10d module)
    torch_names = set()  # local names bound to torch itself
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in COMM_MODULES or any(a.name.startswith(m + ".")
                                                 for m in COMM_MODULES):
                    found.append((node.lineno, f"import {a.name}"))
                elif a.asname and a.name in DIST_MODULES:
                    dist_names.add(a.asname)
                elif a.name == "torch" or a.name.startswith("torch."):
                    torch_names.add(a.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if node.module in DIST_MODULES and _is_comm(a.name):
                    found.append((node.lineno, f"from {node.module} import {a.name}"))
                elif full in DIST_MODULES:
                    dist_names.add(a.asname or a.name)
                elif full in COMM_MODULES or node.module in COMM_MODULES:
                    found.append((node.lineno, f"from {node.module} import {a.name}"))

    def is_dist(expr) -> bool:
        """`dist`, `torch.distributed`, `torch.distributed.distributed_c10d`, `c10d`."""
        if isinstance(expr, ast.Name):
            return expr.id in dist_names
        if isinstance(expr, ast.Attribute):
            if expr.attr == "distributed" and isinstance(expr.value, ast.Name):
                return expr.value.id in torch_names
            if expr.attr == "distributed_c10d":
                return is_dist(expr.value)
        return False

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_comm(node.attr) and is_dist(node.value):
            found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "getattr" and len(node.args) >= 2
              and is_dist(node.args[0]) and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _is_comm(node.args[1].value)):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


@pytest.mark.parametrize("src", [
    "import torch.distributed as dist\ndist.all_gather(a, b, group=g)",
    "import torch.distributed as d\nd.P2POp(d.isend, t, 1, g)",
    "import torch\ntorch.distributed.broadcast(t, 0)",
    "import torch.distributed\ntorch.distributed.barrier()",
    "from torch.distributed import all_to_all_single as a2a\na2a(o, i)",
    "from torch.distributed import reduce_scatter_tensor",
    "from torch import distributed as dist\ndist.isend(t, 1)",
    "from torch.distributed import distributed_c10d as c10d\nc10d.irecv(t, 0)",
    "import torch.distributed.distributed_c10d as c10d\nc10d.batch_isend_irecv(ops)",
    "import torch.distributed as dist\ndist.distributed_c10d.send(t, 1)",
    "import torch.distributed as dist\nf = getattr(dist, 'all_reduce')",
    "def f():\n    import torch.distributed as dist\n    dist.gather_object(o, out, dst=0)",
    "import torch.distributed._functional_collectives as funcol",
    "from torch.distributed.nn.functional import all_gather",
])
def test_finder_catches(src):
    assert comm_calls(src), src


@pytest.mark.parametrize("src", [
    "import torch.distributed as dist\ndist.get_rank(); dist.new_group([0, 1])",
    "import torch.distributed as dist\nop = dist.ReduceOp.MAX",
    "from .topology import all_gather, broadcast\nall_gather(p, x, group=g)\nbroadcast(t, 0, g)",
    "import torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard",
])
def test_finder_passes(src):
    assert not comm_calls(src), src


def test_one_door():
    """Every communication call in workers/ goes through workers/parallel/topology.py or p2p.py."""
    files = sorted((ROOT / "workers").rglob("*.py"))
    assert len(files) > 10
    bad = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel in DOORS:
            continue
        bad += [f"{rel}:{line}: {what}" for line, what in comm_calls(path.read_text())]
    assert not bad, ("torch.distributed communication outside workers/parallel/topology.py and "
                     "workers/parallel/p2p.py (call the wrappers there):\n" + "\n".join(bad))


def test_doors_do_communicate():
    """The finder sees the doors' own calls (a finder that saw nothing would pass above)."""
    for door in DOORS:
        assert comm_calls((ROOT / door).read_text()), door


# -- the plane check -------------------------------------------------------------------------

class _Group:
    """Stands in for a process group: check_plane only asks `is_control`."""


@pytest.fixture
def planes():
    """A data and a control group (fakes; the control one registered as a gloo twin), and
    the check left off afterwards whatever the test set."""
    data, control = _Group(), _Group()
    topology._CONTROL_GROUPS.add(id(control))
    yield data, control
    topology._CONTROL_GROUPS.discard(id(control))
    topology.set_plane_check(None)


def test_check_off_passes_anything(planes):
    data, control = planes
    topology.set_plane_check(None)
    topology.check_plane("all_gather", data, [torch.empty(1, device="meta")])
    topology.check_plane("broadcast", control, [torch.empty(1, device="meta")])
    topology.check_plane("gather_object", data, objects=True)


def test_cpu_tensor_on_a_cuda_data_plane(planes):
    data, _ = planes
    topology.set_plane_check("cuda")
    with pytest.raises(topology.PlaneError) as e:
        topology.check_plane("all_gather", data, [torch.zeros(2)])
    assert str(e.value) == ("all_gather on the data plane got a cpu tensor; the pool's data "
                            "plane carries cuda tensors only (NCCL)")


def test_non_cpu_tensor_on_the_control_plane(planes):
    _, control = planes
    for pool in ("cuda", "cpu"):
        topology.set_plane_check(pool)
        with pytest.raises(topology.PlaneError, match="broadcast on the control plane got a "
                                                      "meta tensor; .* cpu tensors only"):
            topology.check_plane("broadcast", control, [torch.zeros(1, device="meta")])


def test_cpu_pool_catches_only_non_cpu(planes):
    """On a CPU pool both planes carry CPU tensors: only a foreign device fails."""
    data, control = planes
    topology.set_plane_check("cpu")
    topology.check_plane("all_reduce", data, [torch.zeros(3)])
    topology.check_plane("all_reduce", control, [torch.zeros(3)])
    with pytest.raises(topology.PlaneError, match="all_to_all_single on the data plane got a "
                                                  r"meta tensor; .* cpu tensors only \(gloo\)"):
        topology.check_plane("all_to_all_single", data,
                             [torch.zeros(2), torch.zeros(2, device="meta")])


def test_objects_on_the_data_plane(planes):
    data, control = planes
    topology.set_plane_check("cpu")
    topology.check_plane("broadcast_object_list", control, objects=True)
    with pytest.raises(topology.PlaneError, match="broadcast_object_list on the data plane"):
        topology.check_plane("broadcast_object_list", data, objects=True)


def test_correct_placements_pass(planes):
    """A non-CPU pool device without a GPU: "meta" stands in for cuda."""
    data, control = planes
    topology.set_plane_check("meta")
    topology.check_plane("all_gather", data, [torch.empty(2, device="meta")] * 3)
    topology.check_plane("broadcast", control, [torch.zeros(1, dtype=torch.int32)])
    topology.check_plane("gather_object", control, objects=True)
    with pytest.raises(topology.PlaneError, match="all_gather on the data plane got a cpu"):
        topology.check_plane("all_gather", data, [torch.empty(2, device="meta"), torch.zeros(2)])


@pytest.fixture
def world(tmp_path):
    """A 1-rank gloo world in this process, the check on (as the test-mode hooks set it)."""
    import torch.distributed as dist

    w = topology.init_world(0, 1, torch.device("cpu"), dist.FileStore(str(tmp_path / "s"), 1),
                            check_planes=True)
    yield w
    topology.set_plane_check(None)
    dist.destroy_process_group()


def test_wrappers_check_real_groups(world):
    """The wrappers and p2p.post run the check on real groups (data: the world group;
    control: its gloo twin), then communicate as torch would."""
    from workers.parallel import p2p

    assert topology.plane_check() == "cpu"
    parts = [torch.empty(2)]
    topology.all_gather(parts, torch.ones(2), group=world.data)
    assert parts[0].tolist() == [1.0, 1.0]
    flag = torch.ones(1, dtype=torch.int32)
    topology.broadcast(flag, src=0, group=world.control)
    t = torch.tensor([2.0, 5.0])
    topology.all_reduce(t, op="max", group=world.control)
    assert t.tolist() == [2.0, 5.0]
    box = [{"job": 1}]
    topology.broadcast_object_list(box, src=0, group=world.control)
    with pytest.raises(topology.PlaneError, match="all_gather_object on the data plane"):
        topology.all_gather_object([None], {"x": 1}, group=world.data)

    topology.set_plane_check("cuda")  # what a CUDA pool expects of the same call sites
    with pytest.raises(topology.PlaneError, match="^all_gather on the data plane got a cpu "
                                                  "tensor; .* cuda tensors only"):
        topology.all_gather(parts, torch.ones(2), group=world.data)
    with pytest.raises(topology.PlaneError, match="^batch_isend_irecv on the data plane got "
                                                  "a cpu tensor"):
        p2p.exchange([(torch.zeros(1), 0)], [((1,), torch.float32, 0)], world.data, "cpu")
    topology.broadcast(flag, src=0, group=world.control)  # control: CPU is right


def test_check_off_by_default(tmp_path):
    """init_world without the test switch leaves the check off (production)."""
    import torch.distributed as dist

    topology.set_plane_check("cuda")
    topology.init_world(0, 1, torch.device("cpu"), dist.FileStore(str(tmp_path / "s"), 1))
    try:
        assert topology.plane_check() is None
    finally:
        dist.destroy_process_group()


def test_nccl_rules_pools_run_with_the_check_on(model_dir):
    """The NCCL-rules hook turns the check on in every rank (the matrix runs under it), and
    a 2-rank Ulysses job (all-to-all, all-gather, object gathers, stop flags) passes it."""
    from comfyui_xdit import GenerationRequest, ParallelConfig, WorkerPool

    rules = "xdit_testhooks.nccl_rules:install"
    with WorkerPool(str(model_dir("flux")), ParallelConfig(ulysses=2), device="cpu",
                    threads_per_rank=1, worker_hooks=[rules]) as pool:
        got = pool.generate(GenerationRequest(prompt=["a red fox"], seed=1, steps=1,
                                              height=64, width=64, max_sequence_length=8))
    assert [st["hooks"][rules]["plane_check"] for st in got.stats] == ["cpu", "cpu"]

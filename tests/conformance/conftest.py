"""The conformance suite's shared state: warm pools per (family, launch layout), and each
family's one-rank results, computed once.

Items are run family by family (collection is reordered inside this folder), so one family's
pools serve every theme before the next family's launch; they are closed when the next
family starts or the suite ends (memory on a 2-core CI machine)."""
from __future__ import annotations

import pytest

from conftest import LayoutPools

HERE = __name__.rpartition(".")[0]


def _family(item) -> str:
    spec = getattr(item, "callspec", None)
    return spec.params.get("arch", "") if spec else ""


# a family's themes in the order its pools are first needed: the 1- and 2-rank pools, then
# PipeFusion's, then the 4-rank and sharded ones, so at most KEEP pools are open at once and
# none is launched twice; last the single files, whose pools serve nothing else
THEMES = ("test_batch_independence", "test_uneven_exact", "test_model_call", "test_token_timesteps",
          "test_lora", "test_step_cache",
          "test_pipefusion", "test_methods_exact", "test_single_file")
KEEP = 3


def _theme(item) -> int:
    name = item.nodeid.split("::")[0].rpartition("/")[2].removesuffix(".py")
    return THEMES.index(name) if name in THEMES else len(THEMES)


def pytest_collection_modifyitems(session, config, items):
    """Within this folder's contiguous items: family by family, then theme by theme (stable
    within a theme); items of no family (the negative controls) last."""
    from .cases import IDS
    mine = [i for i, item in enumerate(items) if "conformance/" in item.nodeid]
    if not mine:
        return
    lo, hi = mine[0], mine[-1] + 1
    order = {arch: n for n, arch in enumerate(IDS)}
    items[lo:hi] = sorted(items[lo:hi], key=lambda it: (order.get(_family(it), len(order)),
                                                        _theme(it)))


class FamilyPools:
    """LayoutPools for one family at a time: asking for another family closes the last's."""

    def __init__(self, model_dir):
        self.model_dir = model_dir
        self.arch = None
        self.cache = LayoutPools(keep=KEEP)
        self.results: dict = {}

    def get(self, arch: str, config, tag: str = "", path=None, **options):
        """The family's pool for `config` (on `path`, another model of the family such as
        its single file; default its test model)."""
        if arch != self.arch:
            self.close()
            self.arch = arch
        return self.cache.get(path or self.model_dir(arch), config, tag=tag, **options)

    def one_rank(self, arch: str, req):
        """The family's result at one rank (plain gloo), once per request."""
        from comfyui_xdit import ParallelConfig
        key = (arch, repr(req))
        if key not in self.results:
            self.results[key] = self.get(arch, ParallelConfig()).generate(req)
        return self.results[key]

    def close(self) -> None:
        self.cache.close()
        self.arch = None


_OPEN: list = []


@pytest.fixture(scope="session")
def family_pools(model_dir):
    fp = FamilyPools(model_dir)
    _OPEN.append(fp)
    yield fp
    fp.close()


def pytest_runtest_teardown(item, nextitem):
    """The suite's last item closes its pools: the rest of the session runs without them."""
    if nextitem is None or "conformance/" not in nextitem.nodeid:
        for fp in _OPEN:
            fp.close()

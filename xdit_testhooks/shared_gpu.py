"""Shared-GPU test mode: several CUDA ranks on one GPU over gloo (NCCL refuses two ranks on
one device). gloo takes CUDA tensors in broadcast / all_reduce / all_gather /
all_to_all_single but not in send/recv, so workers/p2p.py stages point-to-point through the
host in this mode; the data plane still refuses CPU tensors, which catches control data sent
on it."""


def install(ctx):
    ctx.options["backend"] = "gloo"

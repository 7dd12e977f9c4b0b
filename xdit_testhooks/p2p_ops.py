"""What hooks that wrap torch.distributed's point-to-point need to agree on (the NCCL-rules
emulation here, the benchmarks' byte meter): whether a P2POp's op sends, whoever wrapped it."""


def is_send(fn, sends: set, recvs: set) -> bool:
    """By identity with the known send / receive functions, following `__wrapped__` chains,
    else by name (an unknown wrapper that is not a receive counts as a send)."""
    first, seen = fn, set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        if fn in sends:
            return True
        if fn in recvs:
            return False
        fn = getattr(fn, "__wrapped__", None)
    return "recv" not in getattr(first, "__name__", "")

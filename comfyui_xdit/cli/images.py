"""Writing IMAGE tensors to files (the CLI and the demo)."""
from __future__ import annotations

from pathlib import Path


def save_pngs(images, out: Path) -> list:
    """IMAGE [B,H,W,3] -> out.png, out-1.png, ..."""
    import numpy as np
    from PIL import Image

    paths = []
    for i, img in enumerate(images):
        p = out if i == 0 else out.with_name(f"{out.stem}-{i}{out.suffix}")
        Image.fromarray((img.numpy() * 255).round().clip(0, 255).astype(np.uint8)).save(p)
        paths.append(p)
    return paths

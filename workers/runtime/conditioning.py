"""One conditioning, typed: ComfyUI's CONDITIONING as the pool takes it, with its shape rules,
defined once for both ways a conditioning reaches the workers:

- the xDiT MODEL (comfyui_xdit/nodes/model_calls.py) builds one per chunk of a host-side
  sampler's rows; the protocol's `Predict` carries them and the workers
  (workers/sampling/model_call.py) check and cache them;
- the Sampler (xDiT) node reads one from each CONDITIONING input
  (comfyui_xdit/comfy_convert.py); its text parts are a job request's `positive` /
  `negative` (workers/runtime/request.py), and what belongs to the whole job (references, the
  start image) moves to the request's own fields (`TO_REQUEST`).

Cheap to import (no torch): shapes are read off whatever array type arrives.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Optional


@dataclass
class Conditioning:
    """A chunk of `rows` latent rows' conditioning (fp32 CPU tensors on the wire):

    context:      text states [rows, tokens, D] (ComfyUI's `context`);
    pooled:       pooled text [rows, P] (`y`); None for a family without (FLUX.2);
    context_2:    a second text encoder's states [rows, tokens, D2] (the family's
                  `comfy.text_2`: HunyuanVideo 1.5's ByT5 `txt_byt5`);
    image_embeds: CLIP vision states [rows, tokens, D] (Wan 2.1 I2V's `clip_fea`);
    ref_latents:  reference latents, each [rows, C, h, w] in the call's latent space
                  (model space, unpacked: ComfyUI's `ref_latents`), in order;
    ref_method:   how several references are placed (ComfyUI's `ref_latents_method`);
                  None: the family's default;
    concat_latent, concat_mask: ComfyUI's WanImageToVideo start video (its raw VAE latent)
                  and mask, which a Sampler job takes as its request's; a model call's
                  latents hold them already, so a call refuses them.
    """

    context: Any
    pooled: Any = None
    context_2: Any = None
    image_embeds: Any = None
    ref_latents: Optional[list] = None
    ref_method: Optional[str] = None
    concat_latent: Any = None
    concat_mask: Any = None

    # the text a job request's positive / negative carries
    TEXT: ClassVar[tuple] = ("context", "pooled", "context_2")
    # the start image (image-to-video), named alike here and on a job's request
    START_IMAGE: ClassVar[tuple] = ("concat_latent", "concat_mask", "image_embeds")
    # what a job takes off its conditionings into its request: (this field, the request's)
    TO_REQUEST: ClassVar[tuple] = (("ref_latents", "reference_latents"),
                                   ("ref_method", "reference_method"),
                                   *((f, f) for f in START_IMAGE))

    @property
    def rows(self) -> int:
        return int(self.context.shape[0])

    def problems(self, rows: int) -> list:
        """What breaks the shape rules above for a chunk of `rows` rows, one line each
        (widths and channels are the model's, checked where it is known)."""
        out = []
        for name, dims in (("context", 3), ("pooled", 2), ("context_2", 3),
                           ("image_embeds", 3)):
            v = getattr(self, name)
            if v is None and name != "context":
                continue
            shape = tuple(getattr(v, "shape", ()))
            if len(shape) != dims or shape[0] != rows:
                want = ", ".join([str(rows)] + ["..."] * (dims - 1))
                got = shape if hasattr(v, "shape") else type(v).__name__
                out.append(f"{name} must be [{want}] (got {got})")
        refs = self.ref_latents
        if refs is not None:
            if not isinstance(refs, (list, tuple)) or not refs:
                out.append("ref_latents must be a non-empty list of latents")
            else:
                for i, r in enumerate(refs):
                    shape = tuple(getattr(r, "shape", ()))
                    if len(shape) != 4 or shape[0] != rows or min(shape[-2:]) < 1:
                        got = shape if hasattr(r, "shape") else type(r).__name__
                        out.append(f"reference latent #{i + 1} must be [{rows}, C, h, w] "
                                   f"(got {got})")
        if self.ref_method is not None and not isinstance(self.ref_method, str):
            out.append(f"ref_method must be a name (got {self.ref_method!r})")
        return out

    def call_problems(self, rows: int) -> list:
        """`problems`, plus what a model call cannot take (its latents hold a start image)."""
        return self.problems(rows) + [
            f"{name} is a Sampler job's start image; a model call's latents hold it already "
            f"(ComfyUI's model joins it): leave it out" for name in ("concat_latent",
                                                                    "concat_mask")
            if getattr(self, name) is not None]

    def text(self) -> "Conditioning":
        """Only the text fields (what a job request's positive / negative carries)."""
        return Conditioning(**{f: getattr(self, f) for f in self.TEXT})

    def to_wire(self) -> dict:
        """The fields that are set, by name (plain values and tensors)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    @classmethod
    def from_wire(cls, d) -> "Conditioning":
        """A wire dict (or a Conditioning of either package name) -> Conditioning."""
        if not isinstance(d, dict):
            d = d.to_wire()
        unknown = sorted(set(d) - set(FIELDS))
        if unknown or "context" not in d:
            raise ValueError(f"a conditioning has the fields {list(FIELDS)}, context required "
                             f"(got {sorted(d)})")
        return cls(**d)

    @classmethod
    def given(cls, value) -> "Conditioning":
        """What a caller may give for one (the Python API's positive / negative): a
        Conditioning, of either package name, or a dict of its fields, where `cond` is also
        taken for `context` (the request's name for it before it was typed)."""
        if isinstance(value, dict) and "cond" in value and "context" not in value:
            value = {("context" if k == "cond" else k): v for k, v in value.items()}
        return cls.from_wire(value)

    @classmethod
    def map_from_wire(cls, d: dict) -> dict:
        """{key: conditioning} from the wire."""
        return {str(k): cls.from_wire(v) for k, v in d.items()}


FIELDS = tuple(f.name for f in fields(Conditioning))

"""LoRA on a loaded transformer: files are loaded once as named peft adapters and cached;
each job only switches and re-weights them, so the base model is never reloaded.

Files go through diffusers' own readers (`FluxPipeline.lora_state_dict` converts kohya /
ComfyUI FLUX keys, `Flux2KleinPipeline.lora_state_dict` kohya and BFL FLUX.2 keys; SD3 takes
diffusers/peft keys) and `load_lora_into_transformer`. An empty
LoRA list disables every adapter: peft's LoRA layers then call the untouched base Linear
only, so the base output is restored bitwise.

Rank 0 calls `resolve` before a job is broadcast: it reads and checks every new file (clear
one-line `LoraError`s, nothing changed in the model). Every rank then calls `apply`.
"""
from __future__ import annotations

import hashlib
import os

import torch

_PREFIX = "transformer."


class LoraError(ValueError):
    """A LoRA file that cannot be used; the model is left as it was."""


def adapter_name(path: str) -> str:
    """One adapter per file version: a hash of the path, mtime and size."""
    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_mtime_ns}|{st.st_size}"
    return "lora_" + hashlib.sha1(key.encode()).hexdigest()[:16]


def _base_linear(mod):
    base = getattr(mod, "base_layer", None)  # already wrapped by peft
    return base if base is not None else mod


def _lora_module(key: str):
    """'transformer.a.b.lora_A.weight' -> ('a.b', 'A'); None for other keys."""
    for part in ("A", "B"):
        tag = f".lora_{part}."
        if tag in key:
            return key[len(_PREFIX):].split(tag)[0], part
    return None


# LoRA file formats diffusers' readers convert, per architecture
# a LoRA entry's expert (Wan 2.2 A14B) -> the index of its transformer in model.transformers()
EXPERTS = {None: None, "high": 0, "low": 1}


class LoraManager:
    def __init__(self, adapter, model_path=None):
        self.adapter = adapter
        self.model_path = model_path  # ComfyUI's loaders' patches name a single file's layers
        self._row_maps: dict = {}  # (workers/loading/comfy_lora.py) per model file
        self.arch = adapter.arch
        self.pipeline_class = adapter.lora_pipeline or adapter.pipeline_class
        self.loaded: dict[str, str] = {}  # adapter name -> path
        self.loads = 0  # LoRA files loaded into the model so far
        self.used = False  # a job has asked for LoRA (then every job re-applies the list)
        self.absent: set = set()  # PipeFusion: adapters with no layer on this rank's stage
        self._pending: dict[str, tuple] = {}  # read and checked by resolve, not yet loaded
        self.into: dict[str, set] = {}  # adapter -> the indices of the transformers holding it

    def _pipeline(self):
        import diffusers
        return getattr(diffusers, self.pipeline_class)

    def read(self, path: str, transformer) -> tuple:
        """-> (state dict with 'transformer.' keys, network alphas, metadata), checked
        against `transformer`; raises LoraError naming the file."""
        if not os.path.isfile(path):
            raise LoraError(f"LoRA file not found: {path}")
        from .header import read_safetensors_header
        from .lora_file import lora_file_problem
        problem = lora_file_problem(path)
        if problem:
            raise LoraError(problem)
        from .comfy_lora import is_patches_file, patches_to_peft
        if is_patches_file(path):  # ComfyUI's LoRA loaders' patches (the xDiT MODEL)
            try:
                sd = patches_to_peft(path, transformer, self.adapter, self.model_path,
                                     self._row_maps)
            except ValueError as e:
                raise LoraError(f"ComfyUI's LoRA loader on the xDiT MODEL: {e}")
            return self._checked(path, sd, None, None, transformer)
        file_keys = list(read_safetensors_header(path))
        self.adapter.check_lora_keys(path, file_keys)
        pcls = self._pipeline()
        alphas = None
        try:
            if self.adapter.lora_alphas:
                sd, alphas, metadata = pcls.lora_state_dict(
                    path, return_alphas=True, return_lora_metadata=True, use_safetensors=True)
            else:
                sd, metadata = pcls.lora_state_dict(path, return_lora_metadata=True,
                                                    use_safetensors=True)
        except Exception as e:
            kinds = self.adapter.lora_formats
            raise LoraError(f"LoRA file {path} could not be read as a {self.arch} LoRA "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                            f"is it a LoRA for another model? Give a {kinds} LoRA trained "
                            f"for this {self.arch} model")
        return self._checked(path, sd, alphas, metadata, transformer)

    def _checked(self, path, sd, alphas, metadata, transformer) -> tuple:
        """`read`'s result from a file's state dict: every LoRA key fits a Linear layer."""
        if not any(k.startswith(_PREFIX) for k in sd):
            # bare peft keys ("transformer_blocks.0.attn.to_q.lora_A.weight")
            sd = {(k if k.startswith("text_encoder") else _PREFIX + k): v for k, v in sd.items()}
        tsd = {k: v for k, v in sd.items() if k.startswith(_PREFIX)}
        modules = dict(transformer.named_modules())
        # PipeFusion: blocks held by other stages are RemoteBlocks; their keys are checked
        # and loaded by the rank that holds them
        remote = tuple(n + "." for n, m in modules.items() if type(m).__name__ == "RemoteBlock")
        matched, bad, elsewhere = 0, [], set()
        for k, v in tsd.items():
            ref = _lora_module(k)
            if ref is None:
                continue
            name, part = ref
            if remote and (name + ".").startswith(remote):
                elsewhere.add(k)
                continue
            mod = modules.get(name)
            lin = _base_linear(mod) if mod is not None else None
            if not isinstance(lin, torch.nn.Linear):
                bad.append(f"{k} (no such layer)")
                continue
            want = lin.in_features if part == "A" else lin.out_features
            got = v.shape[1] if part == "A" else v.shape[0]
            if v.dim() != 2 or got != want:
                bad.append(f"{k} (shape {tuple(v.shape)} does not fit {name}: "
                           f"{lin.in_features}->{lin.out_features})")
                continue
            matched += 1
        if not matched and not elsewhere:  # the whole file is for another model
            some = bad[0] if bad else repr(next(iter(sd), "<empty file>"))
            raise LoraError(f"LoRA file {path} has no key that matches this {self.arch} model "
                            f"(e.g. {some}); is it a LoRA for another model?")
        if bad:  # names the layer or shape that does not fit
            raise LoraError(f"LoRA file {path}: {len(bad)} LoRA keys do not fit this "
                            f"{self.arch} model, e.g. {bad[0]}")
        if alphas:
            alphas = {k: v for k, v in alphas.items() if k.startswith(_PREFIX)}
        if elsewhere:
            tsd = {k: v for k, v in tsd.items() if k not in elsewhere}
            if not any(_lora_module(k) for k in tsd):
                tsd = {}  # nothing of this file lives on this rank's stage
        return tsd, alphas, metadata

    def resolve(self, transformer, loras) -> list:
        """Rank 0, before broadcast: [(path, strength[, expert])] -> [(adapter name, path,
        strength, expert or None)]; reads and checks every file not loaded yet (the model is
        not touched). `expert`: "high" | "low", Wan 2.2 A14B's transformer it goes into."""
        out = []
        for entry in loras or []:
            path, strength = entry[0], entry[1]
            expert = entry[2] if len(entry) > 2 else None
            if expert not in EXPERTS:
                raise LoraError(f"LoRA {path}: expert must be 'high' or 'low' (got {expert!r})")
            path = os.path.abspath(os.path.expanduser(str(path)))
            if not os.path.isfile(path):
                raise LoraError(f"LoRA file not found: {path}")
            name = adapter_name(path)
            if name not in self.loaded and name not in self._pending:
                self._pending[name] = self.read(path, transformer)
            out.append((name, path, float(strength), expert))
        return out

    def apply(self, transformer, resolved) -> None:
        """Every rank: load what is new (once per transformer), then activate exactly
        `resolved` with its strengths; [] disables every adapter (the base weights were never
        changed). `transformer`: one, or a model's transformers of one class (Wan 2.2 A14B's
        two experts): an entry naming its expert ("high": the first, "low": the second) goes
        into that one only, any other into each; a file is loaded into a transformer the
        first time an entry needs it there (one adapter name per file)."""
        many = tuple(transformer) if isinstance(transformer, (tuple, list)) else (transformer,)
        if resolved:
            self.used = True
        weights = [dict() for _ in many]  # per transformer: adapter -> strength
        for name, path, strength, expert in resolved:
            if expert is not None and len(many) == 1:
                raise LoraError(f"LoRA {path}: expert {expert!r} names one of Wan 2.2 A14B's "
                                f"two transformers; this model has one")
            at = range(len(many)) if expert is None else [EXPERTS[expert]]
            held = self.into.setdefault(name, set())
            new = [i for i in at if i not in held]
            if new and name not in self.absent:
                tsd, alphas, metadata = self._pending.pop(name, None) or \
                    self.read(path, many[0])
                kw = {"network_alphas": alphas} if self.adapter.lora_alphas else {}
                if tsd:
                    for i in new:  # (the loader consumes the dict it is given)
                        self._pipeline().load_lora_into_transformer(
                            dict(tsd), transformer=many[i], adapter_name=name,
                            metadata=metadata, **kw)
                        held.add(i)
                    self.loads += 1
                elif name not in self.loaded:  # PipeFusion: no layer on this stage
                    self.absent.add(name)
                    self.loads += 1
                self.loaded[name] = path
            if name not in self.absent:
                for i in at:  # listed twice adds up
                    weights[i][name] = weights[i].get(name, 0.0) + strength
        for i, tr in enumerate(many):
            if not any(i in held for held in self.into.values()):
                continue  # no adapter was ever loaded into it
            if weights[i]:
                tr.enable_lora()
                tr.set_adapters(list(weights[i]), list(weights[i].values()))
            else:
                tr.disable_lora()

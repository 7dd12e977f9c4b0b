"""What a LoRA file must be before anything loads it: a readable safetensors file holding
LoRA weights. The host checks this before any worker starts (a wrong file is refused at
once, naming a key the file really holds), and rank 0 checks it again before reading."""
from __future__ import annotations

from .header import ModelFileError, read_safetensors_header

# name parts of the weight formats ComfyUI's LoRA loader maps: diffusers/PEFT (lora_A/B),
# kohya (lora_down/up, alpha), ComfyUI's own (lora.down/up, diff), LoHa / LoKr
LORA_KEY_PARTS = ("lora_A", "lora_B", "lora_down", "lora_up", "lora.down", "lora.up",
                  "lora_linear_layer", "hada_w", "lokr_w", ".diff")


def lora_file_problem(path) -> str:
    """'' for a usable LoRA file, else one line saying what is wrong and what would be
    right (the file exists: the caller checked)."""
    try:
        keys = list(read_safetensors_header(path))
    except ModelFileError as e:
        return f"LoRA file {path}: {e}".replace(" give a transformer file", " give a LoRA file")
    if not any(part in k for k in keys for part in LORA_KEY_PARTS):
        return (f"LoRA file {path} holds no LoRA weights (none of its {len(keys)} tensors is a "
                f"lora_A/lora_B or lora_down/lora_up pair, e.g. {keys[0]!r}); is it a model "
                f"or a checkpoint rather than a LoRA? Give a LoRA .safetensors file")
    return ""

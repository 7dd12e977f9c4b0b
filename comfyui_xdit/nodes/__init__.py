"""What ComfyUI loads: the V3 nodes (extension, model_nodes, comfy_model import ComfyUI)
and their ComfyUI-free logic (logic, model_calls), tested in CI without ComfyUI."""

"""What ComfyUI loads: the V3 nodes (extension, loader_nodes, settings_nodes, sampler_nodes,
node_io, model_nodes and comfy_model import ComfyUI) and their ComfyUI-free parts, tested in
CI without ComfyUI: discovery (which models are listed), settings (the inputs' choices and
the settings nodes' values), handles (the loader's model handle), pool_registry (the warm
pools), operations (sampling, decoding), node_text (descriptions and status lines) and
model_calls (the xDiT MODEL's calls)."""

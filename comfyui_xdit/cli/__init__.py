"""`python -m comfyui_xdit`: the commands, the demo, writing images."""

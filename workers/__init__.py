"""Code that runs inside each worker process (never imports ComfyUI)."""

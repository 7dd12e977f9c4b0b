"""`python -m comfyui_xdit` and the `comfyui-xdit` console script (pyproject.toml)."""
import sys

from comfyui_xdit.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())

import sys

from comfyui_xdit.cli.commands import main

sys.exit(main())

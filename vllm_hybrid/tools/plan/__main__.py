"""``python -m vllm_hybrid.tools.plan``: the same as ``vllm-hybrid plan``."""

import sys

from vllm_hybrid.tools.plan.cli import main

sys.exit(main())

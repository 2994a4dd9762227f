"""Keep library chatter (deprecation notices, CPU-fallback warnings) out of user output."""

from __future__ import annotations

import logging
import os
import warnings


def quiet_libraries() -> None:
    if os.environ.get("MEGATRON_RL_VERBOSE"):
        return
    warnings.filterwarnings("ignore")
    for name in ("megatron", "megatron.core", "torch.distributed", "torch.utils.cpp_extension",
                 "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)

"""Read a request's logits out of an SGLang engine, step by step, for comparisons with a
reference.

SGLang returns logprobs only when asked for them, and a batch asking for logprobs runs dense
(request_plan.py). A custom logit processor sees the logits of every step instead, drop or not:
`LogitsProbe` saves each step's logits row of a request, unchanged, to the folder named by the
request's `custom_params["logits_probe"]` (`0000.pt`, `0001.pt`, ... in step order), leaving out
the rows SGLang samples and discards for the non-final chunks of a chunked prefill. The engine
needs `enable_custom_logit_processor=True`, and `disable_overlap_schedule=True` for one row per
generated token (the overlap scheduler runs a step past the last, and may count a chunk as
pending while the next runs); the request passes `custom_logit_processor=LogitsProbe.to_str()`.
The processor runs in the scheduler process, which imports this module.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List

import torch

from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

PARAM = "logits_probe"


class LogitsProbe(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        for row, params in zip(logits, custom_param_list or []):
            params = params or {}
            folder = params.get(PARAM)
            req = params.get("__req__")
            if folder and getattr(req, "inflight_middle_chunks", 0) <= 0:
                step = len(os.listdir(folder))
                torch.save(row.detach().to("cpu", copy=True),
                           os.path.join(folder, f"{step:04d}.pt"))
        return logits


def read_logits(folder) -> List[torch.Tensor]:
    """The logits the probe saved in `folder`, one [vocab] tensor per step."""
    return [torch.load(p) for p in sorted(Path(folder).glob("*.pt"))]

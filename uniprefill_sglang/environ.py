"""Every `UNIPREFILL_*` environment switch, declared once and read by one rule.

Switches are read at each use (tests and benchmarks set them per process); a flag is on for
"1", "true", "yes" or "on" (any case). They are debug and test aids: serving needs none of them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Tuple

_TRUE = ("1", "true", "yes", "on")


@dataclasses.dataclass(frozen=True)
class Flag:
    name: str
    doc: str

    def get(self) -> bool:
        return os.environ.get(self.name, "0").strip().lower() in _TRUE


@dataclasses.dataclass(frozen=True)
class Choice:
    name: str
    doc: str
    choices: Tuple[str, ...]

    def get(self) -> Optional[str]:
        value = os.environ.get(self.name, "").strip().lower()
        if not value:
            return None
        if value not in self.choices:
            raise ValueError(f"{self.name}={value!r}: expected one of {', '.join(self.choices)}")
        return value


@dataclasses.dataclass(frozen=True)
class Text:
    name: str
    doc: str

    def get(self) -> Optional[str]:
        return os.environ.get(self.name) or None


CHECK_TP = Flag(
    "UNIPREFILL_CHECK_TP",
    "with TP > 1, every drop all-gathers a digest of each rank's selection and raises on a "
    "mismatch (one host sync per drop)")
CHECK_KV_LENS = Flag(
    "UNIPREFILL_CHECK_KV_LENS",
    "every drop and decode step checks the per-stage KV lengths kept on the host against the "
    "slot map on the device and raises on a difference (one sync each)")
REPORT_KEPT = Flag(
    "UNIPREFILL_REPORT_KEPT",
    "meta_info['uniprefill'][i]['kept_digest']: a fingerprint of the kept positions per drop")
FORCE_REFERENCE = Flag(
    "UNIPREFILL_FORCE_REFERENCE", "selection kernels: always the torch reference")
FORCE_TRITON = Flag(
    "UNIPREFILL_FORCE_TRITON",
    "selection kernels: always Triton (CPU tensors need TRITON_INTERPRET=1)")
TEST_FAULT = Choice(
    "UNIPREFILL_TEST_FAULT",
    "test only: 'drop' raises inside every drop (the forward re-runs dense); 'last_drop' only at "
    "the last drop layer of a step in which some request selects (after the earlier drops and "
    "the rejoin of parked rows); 'kv_gaps' corrupts the host KV gaps an "
    "extend records (they are re-read from the device); 'rejoin' at the first drop whenever "
    "parked rows rejoin, in the dense re-run too (the request is failed); 'hook' registers a "
    "hook on a target no SGLang has (start-up must refuse)",
    ("drop", "last_drop", "kv_gaps", "rejoin", "hook"))
FLASHINFER_SLIDING_WINDOW = Flag(
    "UNIPREFILL_FLASHINFER_SLIDING_WINDOW",
    "experimental: FlashInfer serves the drops of a sliding-window model (Gemma 3), its window "
    "layers after a drop through kernels.positional_attention; on an H200 a prompt prefilled in "
    "one step answers as torch_native does, a chunked one (parked rows rejoining) does not yet, "
    "so without it such a model runs dense on FlashInfer")

# Tooling (uniprefill_sglang/tools): where models are converted to, and SGLang's CPU engine.
CACHE = Text("UNIPREFILL_CACHE", "folder of converted models (default ~/.cache/uniprefill_sglang)")
SGL_KERNEL_STUB_DIR = Text(
    "UNIPREFILL_SGL_KERNEL_STUB_DIR", "folder holding the test-only sgl_kernel stand-in")
REPO_ROOT = Text("UNIPREFILL_REPO_ROOT", "a source checkout (its tests/stubs holds the stand-in)")
CPU_ENGINE = Text(
    "UNIPREFILL_CPU_ENGINE", "tests: '1' forces SGLang's CPU engine, '0' forbids it (default: "
    "the CPU engine when CUDA is absent)")

ALL = (CHECK_TP, CHECK_KV_LENS, REPORT_KEPT, FORCE_REFERENCE, FORCE_TRITON, TEST_FAULT,
       FLASHINFER_SLIDING_WINDOW, CACHE, SGL_KERNEL_STUB_DIR, REPO_ROOT, CPU_ENGINE)

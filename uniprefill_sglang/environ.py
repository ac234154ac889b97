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
TEST_SELECTION = Choice(
    "UNIPREFILL_TEST_SELECTION",
    "test only: 'positional' keeps every other block by original position (plus the sinks and "
    "the last queries) instead of the attention's choice, so that every backend keeps the same "
    "positions and their layers after a drop can be compared exactly "
    "(selection.select_by_position)",
    ("positional",))
HYBRID_PREFIX_CACHE = Flag(
    "UNIPREFILL_HYBRID_PREFIX_CACHE",
    "experimental: a family with a recurrent state (Qwen3-Next, LFM2) keeps SGLang's radix "
    "cache (on SGLang 0.5.17 a UnifiedRadixCache with a state component, no_buffer strategy): a "
    "cached prefix's recurrent state is the "
    "state over the survivors its KV holds, and a request reuses both (reuse-sparse; nothing is "
    "re-selected, so the prefix checkpoint is refused); tested on the CPU engine with "
    "Qwen3-Next and LFM2 and on an H200 with Qwen3-Next, on SGLang 0.5.17; without it such a "
    "family runs with the radix cache off")
PREVIEW_BACKENDS = Flag(
    "UNIPREFILL_PREVIEW_BACKENDS",
    "a family is served on its preview attention backends too (architectures.py: DeepSeek's MLA "
    "on fa3 prefill, decoding on Triton), adapters written against SGLang's code that have not "
    "yet passed their GPU tests; without it such a backend runs the family dense, saying why")
DECODE_GRAPH_ENTRIES = Text(
    "UNIPREFILL_DECODE_GRAPH_ENTRIES",
    "test only: entries of each per-stage decode-graph index list (default: two KV pools' "
    "worth, at most upstream's width); a decode batch whose lists hold more runs eagerly")

# Tooling (uniprefill_sglang/tools): where models are converted to, and SGLang's CPU engine.
FLASHINFER_PAGED_TEMPLATE = Choice(
    "UNIPREFILL_FLASHINFER_PAGED_TEMPLATE",
    "'auto' plans FlashInfer's eager paged prefill wrappers on FlashInfer's own template choice "
    "(FA3 on Hopper) instead of SGLang's FA2 (experimental; backends/flashinfer_template.py)",
    ("fa2", "auto"))
CACHE = Text("UNIPREFILL_CACHE", "folder of converted models (default ~/.cache/uniprefill_sglang)")
SGL_KERNEL_STUB_DIR = Text(
    "UNIPREFILL_SGL_KERNEL_STUB_DIR", "folder holding the test-only sgl_kernel stand-in")
REPO_ROOT = Text("UNIPREFILL_REPO_ROOT", "a source checkout (its tests/stubs holds the stand-in)")
CPU_ENGINE = Text(
    "UNIPREFILL_CPU_ENGINE", "tests: '1' forces SGLang's CPU engine, '0' forbids it (default: "
    "the CPU engine when CUDA is absent)")



def kernel_path() -> Optional[str]:
    """The kernels' `path` argument these switches ask for (uniprefill_sglang/kernels: None
    dispatches by device); the reference wins when both are set."""
    if FORCE_REFERENCE.get():
        return "reference"
    if FORCE_TRITON.get():
        return "triton"
    return None


ALL = (CHECK_TP, CHECK_KV_LENS, REPORT_KEPT, FORCE_REFERENCE, FORCE_TRITON, TEST_FAULT,
       TEST_SELECTION, HYBRID_PREFIX_CACHE, PREVIEW_BACKENDS, DECODE_GRAPH_ENTRIES,
       FLASHINFER_PAGED_TEMPLATE, CACHE, SGL_KERNEL_STUB_DIR, REPO_ROOT, CPU_ENGINE)

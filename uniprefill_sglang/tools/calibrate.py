"""Find a drop schedule that keeps a model's answers: ``python -m uniprefill_sglang.tools.calibrate``.

    python -m uniprefill_sglang.tools.calibrate --model smollm2 --lengths 2048,4096,8192 \\
        --target-agreement 0.98 --out smollm2.json

Two steps, so that the search stays cheap:

1. **Offline estimate** (Hugging Face transformers, float32, one dense pass per calibration
   case): hooks record each layer's post-RoPE queries of the last ``--last-queries`` tokens and
   every token's keys, and the same pass greedily answers the case. Every candidate schedule
   (drop layers x top-p x block size) is then replayed on those tensors with the plugin's own
   scoring and selection references: a later drop scores only the survivors of the earlier ones
   (softmax over the survivors' keys). What it cannot see is that after a real drop the later
   layers' hidden states change (they attend to fewer tokens), so their queries and keys differ:
   the replay is an estimate. It predicts, per case, the kept tokens per stage and whether every
   token of the needle (the expected answer in the context) survives, and ranks the candidates.
   The same pass's greedy answer is the dense reference of the calibration cases.
2. **Confirmation** by real generation through SGLang (the CPU engine without CUDA) with
   ``--enable-uniprefill`` and the candidate's drop layers and block size (one engine per layer
   set and block size; top-p per request): the best ``--confirm`` candidates by FLOP saving among
   those whose estimated agreement meets the target, on the calibration cases dense answers
   right. The schedule with the largest FLOP saving whose confirmed agreement meets the target
   wins, and is run again on held-out cases (other seeds and depths) that neither step saw;
   with ``--heldout-tasks`` / ``--heldout-haystacks`` the held-out cases are also of task
   families and haystacks the calibration never saw (a leave-families-out split).
   Agreements in the profile and the table are the confirmed ones. Calibration and held-out
   seeds both come from ``tasks.TUNING_SEEDS``; the ``REPORTING_SEEDS`` that reported figures
   use are refused.

FLOP saving: the prefill FLOPs of the kept tokens per stage (flops.py: each layer priced at its
kind, sliding-window and linear layers at their own cost; the drop layer's attention still sees
every token, its MLP only the survivors) against dense.

Output: a profile JSON (``--uniprefill-profile`` reads it), a PNG heat map beside it (per drop
layer: kept fraction and needle survival at each top-p, for a single drop there) and a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence

from uniprefill_sglang import environ, flops
from uniprefill_sglang.config import DEFAULT_LAST_QUERIES, DEFAULT_SINK_TOKENS
from uniprefill_sglang.flops import FlopShape

NEEDLE_TASKS = ("niah_number", "niah_uuid", "niah_word", "niah_multikey", "niah_multivalue")
TOP_P_GRID = (0.98, 0.99, 0.995, 0.998, 0.999)
BLOCK_SIZES = (16, 32, 64)
MAX_DROPS = 3
PROFILE_FORMAT = "uniprefill-profile/1"
DENSE = {"uniprefill": False}


@dataclasses.dataclass(frozen=True)
class Schedule:
    drop_layers: tuple[int, ...]
    top_p: tuple[float, ...]  # one per drop (the last repeats); a number is one for all
    block_size: int

    def __post_init__(self):
        from uniprefill_sglang.config import parse_fractions

        object.__setattr__(self, "top_p", parse_fractions(self.top_p, "a schedule's top-p"))

    @property
    def name(self) -> str:
        layers = ",".join(map(str, self.drop_layers))
        top_p = ",".join(f"{p:g}" for p in self.top_p)
        return f"layers {layers} top-p {top_p} block {self.block_size}"

    def top_p_json(self):
        """As a profile and a request's knob carry it (config.one_or_list)."""
        from uniprefill_sglang.config import one_or_list

        return one_or_list(self.top_p)


@dataclasses.dataclass
class ModelShape:
    """What the FLOP model and the profile's identity need from the Hugging Face config."""
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    # Each layer's cost by its kind (flops.py); unset: every layer full attention with a dense
    # MLP of the fields above.
    flops: Optional[FlopShape] = None
    # A hybrid's full-attention layers, the only ones a drop can score at (None: every layer).
    full_layers: Optional[tuple[int, ...]] = None

    def __post_init__(self):
        if self.flops is None:
            self.flops = FlopShape.from_config(dict(
                num_hidden_layers=self.num_layers, hidden_size=self.hidden_size,
                intermediate_size=self.intermediate_size, num_attention_heads=self.num_heads,
                num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim))

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelShape":
        from uniprefill_sglang import architectures

        text = getattr(cfg, "text_config", cfg)
        heads = text.num_attention_heads
        kinds = architectures.config_layer_types(text)
        full = architectures.full_attention_layers(kinds, text.num_hidden_layers)
        return cls(architecture=(getattr(text, "architectures", None) or ["?"])[0],
                   num_layers=text.num_hidden_layers, hidden_size=text.hidden_size,
                   intermediate_size=text.intermediate_size, num_heads=heads,
                   num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
                   context_length=getattr(text, "max_position_embeddings", 8192),
                   flops=FlopShape.from_config(cfg),
                   full_layers=None if len(full) == text.num_hidden_layers else full)

    def default_schedule(self) -> "Schedule":
        """The plugin's own default for this model (its architecture's rule and top-p)."""
        from uniprefill_sglang import architectures
        from uniprefill_sglang.config import DEFAULT_TOP_P

        entry = architectures.lookup([self.architecture])
        rule = entry.default_drop_layers if entry else architectures.scaled_reference_layers
        full = self.full_layers if self.full_layers is not None else range(self.num_layers)
        top_p = (entry.top_p if entry else None) or DEFAULT_TOP_P
        return Schedule(tuple(rule(self.num_layers, tuple(full))), top_p, 64)


# ---------------------------------------------------------------------------------------------
# FLOPs


def prefill_flops(kept: Sequence[int], drop_layers: Sequence[int], shape: ModelShape) -> float:
    """Prefill FLOPs of one prompt whose stage s holds ``kept[s]`` tokens (kept[0]: the prompt;
    flops.py)."""
    return flops.prefill_flops(kept, drop_layers, shape.flops)


def flop_ideal_speedup(kept_per_case: Sequence[Sequence[int]], drop_layers: Sequence[int],
                       shape: ModelShape) -> float:
    """Dense FLOPs over UniPrefill FLOPs, summed over the cases."""
    return flops.flop_ideal_speedup(kept_per_case, drop_layers, shape.flops)


# ---------------------------------------------------------------------------------------------
# candidates


def candidate_layer_sets(num_layers: int, max_drops: int = MAX_DROPS,
                         first_step: Optional[int] = None,
                         full_layers: Optional[Sequence[int]] = None) -> list[tuple[int, ...]]:
    """First drop every ``first_step`` layers from layer 2; 1..max_drops drops spread evenly from
    there to 85% of the depth (where the paper's Llama schedule ends). A hybrid scores only at
    its full-attention layers (``full_layers``): each but the last layer can drop first, with
    1..max_drops drops spread evenly over it and the full-attention layers after it."""
    if full_layers is not None:
        usable = [layer for layer in full_layers if 0 < layer < num_layers - 1]
        sets = []
        for i in range(len(usable)):
            pool = usable[i:]
            for n in range(1, min(max_drops, len(pool)) + 1):
                picks = (0,) if n == 1 else tuple(round(k * (len(pool) - 1) / (n - 1))
                                                   for k in range(n))
                layers = tuple(sorted({pool[k] for k in picks}))
                if layers not in sets:
                    sets.append(layers)
        return sets
    step = first_step or max(1, num_layers // 10)
    last = round(0.85 * (num_layers - 1))
    sets = []
    for first in range(2, num_layers - 2, step):
        for n in range(1, max_drops + 1):
            if n == 1:
                layers = (first,)
            elif first + n - 1 > last:
                continue
            else:
                layers = tuple(sorted({round(first + i * (last - first) / (n - 1))
                                       for i in range(n)}))
            if layers not in sets:
                sets.append(layers)
    return sets


def candidate_schedules(layer_sets, top_ps=TOP_P_GRID, block_sizes=BLOCK_SIZES,
                        later_top_ps=()) -> list[Schedule]:
    """Every layer set x block size x top-p; with `later_top_ps`, a set of several drops is
    also tried with each of those at its later drops (the first drop keeping its own top-p)."""
    out = []
    for ls in layer_sets:
        for b in block_sizes:
            for p in top_ps:
                out.append(Schedule(tuple(ls), float(p), int(b)))
                if len(ls) > 1:
                    out += [Schedule(tuple(ls), (float(p), float(q)), int(b))
                            for q in later_top_ps if q != p]
    return out


# ---------------------------------------------------------------------------------------------
# needles


def needle_token_spans(case, offsets: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Per expected answer, the token ranges [start, end) of its every occurrence in the
    context (the question and the answer primer excluded)."""
    context_end = case.prompt.rfind(case.question)
    text = case.prompt[:context_end if context_end > 0 else len(case.prompt)]
    spans = []
    for answer in case.answers:
        occurrences = []
        for m in re.finditer(r"(?<![0-9A-Za-z])" + re.escape(answer) + r"(?![0-9A-Za-z])",
                             text, flags=re.IGNORECASE):
            tokens = [i for i, (a, b) in enumerate(offsets) if b > m.start() and a < m.end()]
            if tokens:
                occurrences.append((tokens[0], tokens[-1] + 1))
        spans.append(occurrences)
    return spans


def needle_survives(kept_positions, spans) -> bool:
    """Every answer has at least one occurrence whose tokens all survive."""
    import torch

    kept = torch.zeros(int(kept_positions.max()) + 1 if kept_positions.numel() else 1,
                       dtype=torch.bool)
    kept[kept_positions] = True

    def whole(a, b):
        return b <= kept.numel() and bool(kept[a:b].all())

    return all(any(whole(a, b) for a, b in occ) for occ in spans)


# ---------------------------------------------------------------------------------------------
# offline: one dense pass per case, then every schedule replayed on its queries and keys


class DensePass:
    """A Hugging Face model whose attention layers record post-RoPE queries (last tokens) and
    keys of one prefill, as its attention computes them (per-head norms included)."""

    def __init__(self, model_path: str, last_queries: int, device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
        self.model.eval()
        self.last_queries = last_queries
        self.recording = False
        self.queries: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        layers = self.model.model.layers
        for i, layer in enumerate(layers):
            layer.self_attn.register_forward_pre_hook(self._hook(i), with_kwargs=True)
        self.sm_scale = layers[0].self_attn.scaling

    def _hook(self, layer_idx: int):
        from transformers.models.llama.modeling_llama import rotate_half

        def record(module, args, kwargs):
            if not self.recording:
                return
            hidden = kwargs.get("hidden_states", args[0] if args else None)[0]  # [N, H]
            cos, sin = (t[0].unsqueeze(1) for t in kwargs["position_embeddings"])  # [N, 1, D]
            d, n_q = module.head_dim, self.last_queries
            q = module.q_proj(hidden[-n_q:]).view(-1, module.config.num_attention_heads, d)
            k = module.k_proj(hidden).view(hidden.shape[0], -1, d)
            # Gemma 3 and Qwen3 normalise each head's query and key before RoPE
            if getattr(module, "q_norm", None) is not None:
                q, k = module.q_norm(q), module.k_norm(k)
            self.queries[layer_idx] = (q * cos[-n_q:] + rotate_half(q) * sin[-n_q:]).detach().cpu()
            self.keys[layer_idx] = (k * cos + rotate_half(k) * sin).detach().cpu()

        return record

    def run(self, input_ids: list[int], max_new_tokens: int, eos_ids) -> list[int]:
        """Prefill (recording) and greedy decode; returns the generated ids."""
        import torch

        with torch.inference_mode():
            self.recording = True
            out = self.model(input_ids=torch.tensor([input_ids], device=self.device), use_cache=True,
                             logits_to_keep=1)
            self.recording = False
            cache, generated = out.past_key_values, []
            next_id = int(out.logits[0, -1].argmax())
            while True:
                generated.append(next_id)
                if next_id in eos_ids or len(generated) >= max_new_tokens:
                    break
                out = self.model(input_ids=torch.tensor([[next_id]], device=self.device),
                                 past_key_values=cache,
                                 use_cache=True)
                cache = out.past_key_values
                next_id = int(out.logits[0, -1].argmax())
        return generated


class ScheduleReplay:
    """Replays drop schedules on one case's recorded queries and keys (cumulative drops; the
    selection rule of the plugin, kernels/reference.py)."""

    def __init__(self, queries, keys, sm_scale: float, sink_tokens: int, last_queries: int,
                 neighbor_blocks: int = 0):
        import torch

        self.queries, self.keys, self.sm_scale = queries, keys, sm_scale
        self.sink_tokens, self.last_queries = sink_tokens, last_queries
        self.neighbor_blocks = neighbor_blocks
        self.num_tokens = next(iter(keys.values())).shape[0]
        n_q = next(iter(queries.values())).shape[0]
        self.query_pos = torch.arange(self.num_tokens - n_q, self.num_tokens)
        self._first_scores: dict[int, "torch.Tensor"] = {}
        self._survivors: dict[tuple, "torch.Tensor"] = {}

    def _scores(self, layer: int, positions):
        from uniprefill_sglang.kernels.reference import score_segment_reference

        return score_segment_reference(self.queries[layer], self.query_pos,
                                       self.keys[layer][positions], positions, self.sm_scale)

    def survivors(self, drop_layers: tuple[int, ...], top_p, block_size: int):
        """Positions left after the last of ``drop_layers``; ``top_p`` one per drop (the last
        repeats), or one number for all."""
        import torch

        from uniprefill_sglang.selection import SelectionRule, segment_keep_reference

        if not drop_layers:
            return torch.arange(self.num_tokens)
        from uniprefill_sglang.config import parse_fractions, per_drop

        top_p = parse_fractions(top_p, "a replay's top-p")
        top_p = tuple(per_drop(top_p, i) for i in range(len(drop_layers)))
        key = (drop_layers, top_p, block_size)
        if key not in self._survivors:
            before = self.survivors(drop_layers[:-1], top_p[:-1], block_size)
            layer = drop_layers[-1]
            if len(drop_layers) == 1:  # every token scores: shared by all top-p / block sizes
                if layer not in self._first_scores:
                    self._first_scores[layer] = self._scores(layer, before)
                scores = self._first_scores[layer]
            else:
                scores = self._scores(layer, before)
            rule = SelectionRule(block_size, self.sink_tokens, self.last_queries,
                                 self.neighbor_blocks)
            keep = segment_keep_reference(scores, before, rule, top_p[-1], 0.0)
            self._survivors[key] = before[torch.tensor(keep, dtype=torch.bool)]
        return self._survivors[key]

    def kept_per_stage(self, schedule: Schedule) -> list[int]:
        return [self.num_tokens] + [
            int(self.survivors(schedule.drop_layers[:i + 1], schedule.top_p,
                               schedule.block_size).numel())
            for i in range(len(schedule.drop_layers))]


def estimate_cases(model_path: str, cases, schedules: Sequence[Schedule], heatmap_layers,
                   tokenizer, sink_tokens: int, last_queries: int, progress: bool = True,
                   device: str = "cpu", top_ps: Sequence[float] = TOP_P_GRID,
                   neighbor_blocks: int = 0):
    """Per case: the dense answer (HF), the needle spans, and per schedule the estimated kept
    tokens per stage and needle survival; plus single-drop figures per layer for the heat map."""
    from tqdm import tqdm

    dense_pass = DensePass(model_path, last_queries, device)
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    records = []
    for case in tqdm(cases, desc="offline dense pass + replay", unit="case", disable=not progress,
                     file=sys.stderr):
        generated = dense_pass.run(case.input_ids, case.max_new_tokens, eos)
        text = tokenizer.decode(generated, skip_special_tokens=True)
        enc = tokenizer(case.prompt, return_offsets_mapping=True)
        if list(enc["input_ids"]) != list(case.input_ids):
            raise RuntimeError(f"{case.name}: offsets do not match the case's token ids")
        spans = needle_token_spans(case, enc["offset_mapping"])
        replay = ScheduleReplay(dense_pass.queries, dense_pass.keys, dense_pass.sm_scale,
                                sink_tokens, last_queries, neighbor_blocks)
        per_schedule = {}
        for s in schedules:
            final = replay.survivors(s.drop_layers, s.top_p, s.block_size)
            per_schedule[s] = {"kept": replay.kept_per_stage(s),
                               "needle_kept": needle_survives(final, spans)}
        single = {}
        for layer in heatmap_layers:
            for p in top_ps:
                final = replay.survivors((layer,), (p,), heatmap_layers[layer])
                single[(layer, p)] = (final.numel() / replay.num_tokens,
                                      needle_survives(final, spans))
        records.append({"case": case, "hf_dense_text": text,
                        "hf_dense_correct": case.check(text), "schedules": per_schedule,
                        "single_drop": single})
        dense_pass.queries.clear()
        dense_pass.keys.clear()
        del replay
    del dense_pass
    gc.collect()
    return records


def summarize_estimates(records, schedules, shape: ModelShape, lengths) -> list[dict]:
    """Per schedule: estimated agreement (needle kept, on the cases HF dense answers right),
    kept after the last drop and FLOP-ideal speed-up per length."""
    right = [r for r in records if r["hf_dense_correct"]] or records
    rows = []
    for s in schedules:
        kept_by_len = defaultdict(list)
        for r in records:
            kept_by_len[r["case"].target_tokens].append(r["schedules"][s]["kept"])
        agree = sum(r["schedules"][s]["needle_kept"] for r in right)
        rows.append({
            "schedule": s, "est_agree": agree, "est_cases": len(right),
            "est_agreement": agree / len(right),
            "est_kept_final": {L: _final_fraction(kept_by_len[L]) for L in lengths},
            "est_flop_ideal": {L: flop_ideal_speedup(kept_by_len[L], s.drop_layers, shape)
                               for L in lengths},
        })
    return rows


def _final_fraction(kept_per_case) -> float:
    return sum(k[-1] for k in kept_per_case) / max(1, sum(k[0] for k in kept_per_case))


def _stage_fractions(kept_per_case) -> list[float]:
    stages = max(len(k) for k in kept_per_case)
    total = sum(k[0] for k in kept_per_case)
    return [sum(k[min(s, len(k) - 1)] for k in kept_per_case) / total for s in range(1, stages)]


# ---------------------------------------------------------------------------------------------
# confirmation through SGLang


def _use_cpu_engine() -> bool:
    import torch

    flag = environ.CPU_ENGINE.get()
    return flag == "1" if flag is not None else not torch.cuda.is_available()


def start_engine(model_path: str, drop_layers, block_size: int, extra_kwargs: dict):
    # No profile: the candidate alone decides (top-p comes with each request).
    kwargs = dict(enable_uniprefill=True, disable_radix_cache=True, uniprefill_profile="none",
                  uniprefill_drop_layers=",".join(map(str, drop_layers)) or "none",
                  uniprefill_block_size=block_size, **extra_kwargs)
    if _use_cpu_engine():
        from uniprefill_sglang.tools.cpu_engine import make_cpu_engine

        return make_cpu_engine(model_path, **kwargs)
    import sglang

    return sglang.Engine(model_path=model_path, **kwargs)


def generate(engine, case, custom_params: dict) -> dict:
    out = engine.generate(input_ids=case.input_ids, sampling_params={
        "temperature": 0.0, "max_new_tokens": case.max_new_tokens,
        "custom_params": custom_params})
    entry = (out["meta_info"].get("uniprefill") or [{}])[-1]
    return {"text": out["text"], "correct": case.check(out["text"]),
            "kept": entry.get("kept_tokens") or [len(case.input_ids)]}


def measured_summary(runs: list[dict], dense: dict, cases, schedule: Optional[Schedule],
                     shape: ModelShape, lengths) -> dict:
    """Agreement on the cases dense answers right; kept fractions and FLOP-ideal per length."""
    right = [c for c in cases if dense[c.name]["correct"]]
    by_name = {r["case"]: r for r in runs}
    agree = sum(by_name[c.name]["correct"] for c in right if c.name in by_name)
    out = {"agree": agree, "dense_correct": len(right), "cases": len(cases),
           "agreement": agree / len(right) if right else None,
           "failed": [c.name for c in right if c.name in by_name and not by_name[c.name]["correct"]],
           "kept_fractions": {}, "flop_ideal_speedup": {}}
    for L in lengths:
        kept = [by_name[c.name]["kept"] for c in cases if c.target_tokens == L and c.name in by_name]
        if kept and schedule is not None:
            out["kept_fractions"][str(L)] = [round(x, 4) for x in _stage_fractions(kept)] \
                if max(len(k) for k in kept) > 1 else []
            out["flop_ideal_speedup"][str(L)] = round(
                flop_ideal_speedup(kept, schedule.drop_layers, shape), 3)
    return out


class EngineSwitcher:
    """One SGLang engine at a time, restarted when a schedule needs other drop layers or another
    block size (top-p comes with each request)."""

    def __init__(self, model_path: str, engine_kwargs: dict):
        self.model_path, self.engine_kwargs = model_path, engine_kwargs
        self.engine, self.key, self.started = None, None, 0

    def use(self, schedule: Schedule):
        key = _engine_key(schedule)
        if self.key == key:
            return self.engine
        self.shutdown()
        self.engine = start_engine(self.model_path, *key, self.engine_kwargs)
        self.key, self.started = key, self.started + 1
        return self.engine

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
            gc.collect()
        self.key = None


def _engine_key(schedule: Schedule) -> tuple:
    return schedule.drop_layers, schedule.block_size


def _progress_bar(cases, desc: str, progress: bool):
    from tqdm import tqdm

    return tqdm(cases, desc=desc, unit="req", disable=not progress, file=sys.stderr)


def confirm_candidates(setup: Setup, engines: EngineSwitcher, rows: list[dict],
                       dense: dict) -> None:
    """Generate with each candidate on the calibration cases dense answers right, stopping once
    it cannot meet the target; stores its measured summary in row["confirmed"] and its answers
    in row["runs"]."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[_engine_key(r["schedule"])].append(r)
    right = [c for c in setup.calibration if dense[c.name]["correct"]]
    allowed_misses = math.floor((1 - setup.args.target_agreement) * len(right) + 1e-9)
    # The group of the best estimate last: if it wins, its engine serves the held-out cases.
    for group in reversed(list(groups.values())):
        engine = engines.use(group[0]["schedule"])
        for r in group:
            s, runs, misses = r["schedule"], [], 0
            for c in _progress_bar(right, f"confirm {s.name}", setup.progress):
                res = {"case": c.name, **generate(engine, c, {"uniprefill_top_p": s.top_p_json()})}
                runs.append(res)
                misses += not res["correct"]
                if misses > allowed_misses:  # cannot meet the target any more
                    break
            r["confirmed"] = measured_summary(runs, dense, setup.calibration, s, setup.shape,
                                              setup.lengths)
            r["confirmed"]["stopped_early"] = len(runs) < len(right)
            r["runs"] = runs


def choose_schedule(confirmed: list[dict], target_agreement: float, longest: int) -> dict:
    """The candidate with the largest confirmed FLOP saving at the longest length among those
    that met the target on every calibration case; else the one that agreed most often."""
    meeting = [r for r in confirmed if r["confirmed"]["agreement"] is not None
               and r["confirmed"]["agreement"] >= target_agreement
               and not r["confirmed"]["stopped_early"]]
    if meeting:
        return max(meeting, key=lambda r: (
            r["confirmed"]["flop_ideal_speedup"].get(str(longest), 1.0),
            r["est_flop_ideal"][longest]))
    return max(confirmed, key=lambda r: (r["confirmed"]["agree"], r["est_flop_ideal"][longest]))


def heldout_summary(setup: Setup, engine, schedule: Schedule, dense: dict, desc: str) -> dict:
    """`schedule` on the held-out cases dense answers right (dense already answered them all)."""
    right = [c for c in setup.heldout if dense[c.name]["correct"]]
    runs = [{"case": c.name, **generate(engine, c, {"uniprefill_top_p": schedule.top_p_json()})}
            for c in _progress_bar(right, desc, setup.progress)]
    return measured_summary(runs, dense, setup.heldout, schedule, setup.shape, setup.lengths)


# ---------------------------------------------------------------------------------------------
# report


def heatmap(records, heatmap_layers, lengths, path: str, title: str,
            top_ps: Sequence[float] = TOP_P_GRID) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    layers = sorted(heatmap_layers)
    kept = np.zeros((len(layers), len(top_ps)))
    survive = np.zeros_like(kept)
    for i, layer in enumerate(layers):
        for j, p in enumerate(top_ps):
            vals = [r["single_drop"][(layer, p)] for r in records]
            kept[i, j] = np.mean([v[0] for v in vals])
            survive[i, j] = np.mean([v[1] for v in vals])
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.32 * len(layers) + 2.2))
    for ax, data, label in ((axes[0], kept, "kept fraction"),
                            (axes[1], survive, "needle kept (fraction of cases)")):
        im = ax.imshow(data, aspect="auto", cmap="viridis", vmin=0, vmax=1)
        ax.set_xticks(range(len(top_ps)), [f"{p:g}" for p in top_ps])
        ax.set_yticks(range(len(layers)), [str(l) for l in layers])
        ax.set_xlabel("top-p")
        ax.set_ylabel("drop layer (single drop)")
        ax.set_title(label, fontsize=10)
        for (i, j), v in np.ndenumerate(data):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6,
                    color="white" if v < 0.6 else "black")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(f"{title}\n{len(records)} calibration cases, "
                 f"{'/'.join(str(L) for L in lengths)} tokens; block size "
                 f"{'/'.join(sorted({str(b) for b in heatmap_layers.values()}))}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(rows: list[dict], lengths) -> str:
    head = ("| schedule | est. agreement | confirmed (calibration) | "
            + " | ".join(f"kept {L} / FLOP-ideal" for L in lengths) + " |")
    lines = [head, "|" + "---|" * (3 + len(lengths))]
    for r in rows:
        conf = r.get("confirmed")
        confirmed = "-" if conf is None else f"{conf['agree']}/{conf['dense_correct']}"
        cells = []
        for L in lengths:
            if conf and str(L) in conf["flop_ideal_speedup"]:
                kept = (conf["kept_fractions"][str(L)] or [1.0])[-1]
                cells.append(f"{kept:.0%} / {conf['flop_ideal_speedup'][str(L)]:.2f}x")
            else:
                cells.append(f"{r['est_kept_final'][L]:.0%} / {r['est_flop_ideal'][L]:.2f}x (est.)")
        lines.append(f"| {r['schedule'].name}{r.get('tag', '')} | {r['est_agree']}/{r['est_cases']} | "
                     f"{confirmed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _schedule_json(schedule: Schedule) -> dict:
    return {"drop_layers": list(schedule.drop_layers), "top_p": schedule.top_p_json(),
            "block_size": schedule.block_size}


def _estimate_json(row: dict) -> dict:
    return {"agree": row["est_agree"], "cases": row["est_cases"],
            "kept_final": {str(L): round(v, 4) for L, v in row["est_kept_final"].items()},
            "flop_ideal_speedup": {str(L): round(v, 3) for L, v in row["est_flop_ideal"].items()}}


def _agreement_json(summary: dict) -> dict:
    return {k: summary[k] for k in ("agree", "dense_correct", "cases", "agreement", "failed")}


def _speedups(summary: dict) -> str:
    return ", ".join(f"{L}: {v:.2f}x" for L, v in summary["flop_ideal_speedup"].items())


def _git_commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).resolve().parent,
                              check=True).stdout.strip() or None
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# CLI


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m uniprefill_sglang.tools.calibrate",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True,
                    help="a Hugging Face model folder, or smollm2 (converted once by model_zoo)")
    ap.add_argument("--lengths", default="2048,4096,8192", help="prompt token budgets")
    ap.add_argument("--target-agreement", type=float, default=0.98)
    ap.add_argument("--out", default="uniprefill_profile.json")
    ap.add_argument("--tasks", default=",".join(NEEDLE_TASKS))
    ap.add_argument("--depths", default="0.2,0.5,0.8",
                    help="calibration needle depths, cycled over the task x length grid")
    ap.add_argument("--seeds", default="0",
                    help="calibration seeds (from tasks.TUNING_SEEDS, 0-999)")
    ap.add_argument("--haystacks", default="noise",
                    help="calibration haystacks (tools/haystacks.py) of the needle tasks")
    ap.add_argument("--heldout-tasks", default=None,
                    help="held-out task families (default: --tasks)")
    ap.add_argument("--heldout-haystacks", default=None,
                    help="held-out haystacks (default: --haystacks)")
    ap.add_argument("--heldout-depths", default="0.1,0.4,0.7,0.9")
    ap.add_argument("--heldout-seeds", default="1",
                    help="held-out seeds (none of --seeds; also from tasks.TUNING_SEEDS: the "
                         "REPORTING_SEEDS stay unseen by calibration)")
    ap.add_argument("--top-p", default=",".join(map(str, TOP_P_GRID)), help="top-p candidates")
    ap.add_argument("--later-top-p", default="",
                    help="top-p candidates for the drops after the first (empty: each schedule "
                         "keeps one top-p at every drop)")
    ap.add_argument("--block-sizes", default=",".join(map(str, BLOCK_SIZES)))
    ap.add_argument("--max-drops", type=int, default=MAX_DROPS)
    ap.add_argument("--offline-threads", type=int, default=None,
                    help="torch threads of the offline pass (1 is fastest on a loaded machine)")
    ap.add_argument("--first-layer-step", type=int, default=None,
                    help="first drop layer every N layers (default depth // 10)")
    ap.add_argument("--layer-sets", default=None,
                    help="explicit candidate drop-layer sets, ';'-separated (e.g. '4;4,12')")
    ap.add_argument("--max-cases", type=int, default=None,
                    help="use only the first N calibration and N held-out cases (smoke runs)")
    ap.add_argument("--confirm", type=int, default=3,
                    help="candidates confirmed by generation, best estimated FLOP saving first")
    ap.add_argument("--offline-only", action="store_true",
                    help="stop after the offline replay: write every candidate's estimate "
                         "(needle survival per case, kept tokens) to --out, start no engine")
    ap.add_argument("--compare-default", action="store_true",
                    help="also run the default schedule on the held-out cases (one more engine)")
    ap.add_argument("--neighbor-blocks", type=int, default=0,
                    help="every candidate also keeps the blocks next to its N top blocks "
                         "(--uniprefill-neighbor-blocks), in the replay and the engine; the "
                         "profile carries it")
    ap.add_argument("--sink-tokens", type=int, default=DEFAULT_SINK_TOKENS,
                    help="always-kept first tokens, in the replay, the engines and the profile")
    ap.add_argument("--last-queries", type=int, default=DEFAULT_LAST_QUERIES,
                    help="scoring queries (the prompt's last N tokens, always kept), in the "
                         "replay, the engines and the profile")
    ap.add_argument("--engine-kwargs", default="{}", help="JSON of extra sglang.Engine kwargs")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.neighbor_blocks < 0:
        ap.error(f"--neighbor-blocks must be >= 0, got {args.neighbor_blocks}")
    if set(_ints(args.seeds)) & set(_ints(args.heldout_seeds)):
        ap.error("--heldout-seeds must not share a seed with --seeds")
    from uniprefill_sglang.tools.tasks import TUNING_SEEDS

    outside = sorted(set(_ints(args.seeds) + _ints(args.heldout_seeds)) - set(TUNING_SEEDS))
    if outside:
        ap.error(f"seeds {outside} are not tuning seeds (tasks.TUNING_SEEDS, "
                 f"{TUNING_SEEDS[0]}-{TUNING_SEEDS[-1]}): calibration never sees the reporting "
                 "seeds")
    return args


# ---------------------------------------------------------------------------------------------
# the run: set-up, offline estimate, confirmation, outputs


@dataclasses.dataclass
class Setup:
    """The flags, the model and the cases that every step of a run reads."""
    args: argparse.Namespace
    command: str
    started: datetime.datetime
    model_path: str
    shape: ModelShape
    tokenizer: object
    engine_kwargs: dict
    tasks: list[str]
    lengths: list[int]
    haystacks: list[str] = dataclasses.field(default_factory=lambda: ["noise"])
    heldout_tasks: list[str] = dataclasses.field(default_factory=list)
    heldout_haystacks: list[str] = dataclasses.field(default_factory=list)
    calibration: list = dataclasses.field(default_factory=list)
    heldout: list = dataclasses.field(default_factory=list)

    @property
    def progress(self) -> bool:
        return not self.args.no_progress

    @property
    def longest(self) -> int:
        return max(self.lengths)


@dataclasses.dataclass
class SearchSpace:
    layer_sets: list[tuple[int, ...]]
    schedules: list[Schedule]
    default: Schedule  # the plugin's own default, estimated beside the candidates
    heatmap_layers: dict[int, int]  # single drop layer -> its block size in the heat map


@dataclasses.dataclass
class Estimates:
    records: list[dict]  # per calibration case (estimate_cases)
    rows: list[dict]  # per candidate schedule (summarize_estimates)
    default_row: dict
    passing: list[dict]  # the rows meeting the target, largest FLOP saving first
    to_confirm: list[dict]
    seconds: float


@dataclasses.dataclass
class Confirmation:
    confirmed: list[dict]  # estimate rows with their "confirmed" summary and "runs"
    best: dict
    heldout: dict  # measured_summary of the chosen schedule on the held-out cases
    default_heldout: Optional[dict]
    engines_started: int
    seconds: float


def prepare_run(args, argv: list[str], started: datetime.datetime) -> Setup:
    """Load the model's config and tokenizer and build the calibration and held-out cases."""
    if _use_cpu_engine():
        from uniprefill_sglang.tools.cpu_engine import activate_cpu_engine_env

        activate_cpu_engine_env()  # before anything imports sglang
    from transformers import AutoConfig, AutoTokenizer

    from uniprefill_sglang.tools.model_zoo import MODELS, prepare_model

    model_path = prepare_model(args.model) if args.model in MODELS else args.model
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(model_path))
    budget = shape.context_length - 64  # room for the answer within the context
    lengths = [min(L, budget) for L in _ints(args.lengths)]
    # The engines' context holds the longest case and its answer (the CPU engine's default,
    # 8192, would refuse an 8K case of a model whose own context is longer).
    engine_kwargs = {"context_length": min(shape.context_length, max(lengths) + 256),
                     **({"uniprefill_neighbor_blocks": args.neighbor_blocks}
                        if args.neighbor_blocks else {}),
                     # the replay's scoring window and sinks, in the engines too
                     "uniprefill_last_queries": args.last_queries,
                     "uniprefill_sink_tokens": args.sink_tokens,
                     **json.loads(args.engine_kwargs)}
    setup = Setup(args=args, command="python -m uniprefill_sglang.tools.calibrate " + " ".join(argv),
                  started=started, model_path=model_path, shape=shape,
                  tokenizer=AutoTokenizer.from_pretrained(model_path),
                  engine_kwargs=engine_kwargs, tasks=_names(args.tasks), lengths=lengths,
                  haystacks=_names(args.haystacks))
    setup.heldout_tasks = _names(args.heldout_tasks) if args.heldout_tasks else setup.tasks
    setup.heldout_haystacks = (_names(args.heldout_haystacks) if args.heldout_haystacks
                               else setup.haystacks)
    setup.calibration = _cases(setup, _ints(args.seeds), _floats(args.depths), setup.tasks,
                               setup.haystacks)
    setup.heldout = _cases(setup, _ints(args.heldout_seeds), _floats(args.heldout_depths),
                           setup.heldout_tasks, setup.heldout_haystacks)
    return setup


def _names(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def case_grid(seeds, lengths, tasks, haystacks) -> list[tuple]:
    """(seed, length, task, haystack) cells; a task without a haystack (tasks.HAYSTACK_TASKS
    have one) takes the noise filler once instead of once per haystack."""
    from uniprefill_sglang.tools.tasks import HAYSTACK_TASKS

    return [(s, L, t, h) for s in seeds for L in lengths for t in tasks
            for h in (haystacks if t in HAYSTACK_TASKS else ["noise"])]


def unseen_families(calibration: Sequence, heldout: Sequence) -> bool:
    """Whether no held-out case shares its (task, haystack) with a calibration case."""
    seen = {(c.task, c.haystack) for c in calibration}
    return not any((c.task, c.haystack) in seen for c in heldout)


def _cases(setup: Setup, seeds, depths, tasks, haystacks) -> list:
    """One case per cell of the seed x length x task x haystack grid, the depths cycling over
    the grid (varied needle positions)."""
    from uniprefill_sglang.tools.tasks import TUNING_SEEDS, make_case

    if not set(seeds) <= set(TUNING_SEEDS):
        raise ValueError(f"calibration uses tuning seeds only; got {sorted(seeds)}")
    grid = case_grid(seeds, setup.lengths, tasks, haystacks)
    grid = grid[:setup.args.max_cases] if setup.args.max_cases else grid
    return [make_case(setup.tokenizer, t, L, depths[i % len(depths)], s, haystack=h)
            for i, (s, L, t, h) in enumerate(grid)]


def search_space(args, shape: ModelShape) -> SearchSpace:
    if args.layer_sets:
        layer_sets = [tuple(_ints(s)) for s in args.layer_sets.split(";")]
    else:
        layer_sets = candidate_layer_sets(shape.num_layers, args.max_drops, args.first_layer_step,
                                          shape.full_layers)
    return SearchSpace(
        layer_sets=layer_sets,
        schedules=candidate_schedules(layer_sets, _floats(args.top_p), _ints(args.block_sizes),
                                      _floats(args.later_top_p) if args.later_top_p else ()),
        default=shape.default_schedule(),
        # Every layer that a candidate drops first at, at the smallest block size.
        heatmap_layers={ls[0]: min(_ints(args.block_sizes)) for ls in layer_sets})


def pareto_front(rows: list[dict], longest: int) -> list[dict]:
    """The rows no other row beats in both estimated agreement and FLOP-ideal speed-up at the
    longest length (ties kept), by speed-up ascending: the accuracy-versus-speed curve."""
    def point(r):
        return r["est_flop_ideal"][longest], r["est_agreement"]

    front = [r for r in rows if not any(
        point(o)[0] >= point(r)[0] and point(o)[1] >= point(r)[1] and point(o) != point(r)
        for o in rows)]
    return sorted(front, key=point)


def frontier_plot(rows: list[dict], default_row: dict, chosen: dict, longest: int, path: str,
                  title: str) -> str:
    """Every candidate's estimated agreement against its FLOP-ideal speed-up at the longest
    length, the Pareto front joined, the chosen and the default schedules marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.scatter([r["est_flop_ideal"][longest] for r in rows], [r["est_agreement"] for r in rows],
               s=10, color="0.65", label=f"candidates ({len(rows)})")
    front = pareto_front(rows, longest)
    ax.plot([r["est_flop_ideal"][longest] for r in front], [r["est_agreement"] for r in front],
            "-o", ms=4, color="tab:blue", label="Pareto front")
    for row, label, color in ((chosen, f"chosen: {chosen['schedule'].name}", "tab:green"),
                              (default_row, f"default: {default_row['schedule'].name}",
                               "tab:red")):
        ax.scatter([row["est_flop_ideal"][longest]], [row["est_agreement"]], s=60, marker="*",
                   color=color, label=label, zorder=3)
    ax.set_xlabel(f"FLOP-ideal prefill speed-up at {longest} tokens (estimated)")
    ax.set_ylabel("needle kept, dense-right calibration cases (estimated)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def estimate(setup: Setup, space: SearchSpace) -> Estimates:
    """The offline step: replay every candidate (and the default) on the calibration cases and
    pick the candidates to confirm."""
    import torch

    args = setup.args
    t0 = time.perf_counter()
    if args.offline_threads:
        torch.set_num_threads(args.offline_threads)
    records = estimate_cases(setup.model_path, setup.calibration, [*space.schedules, space.default],
                             space.heatmap_layers, setup.tokenizer, args.sink_tokens,
                             args.last_queries, setup.progress,
                             "cuda" if torch.cuda.is_available() else "cpu", _floats(args.top_p),
                             args.neighbor_blocks)
    seconds = time.perf_counter() - t0
    rows = summarize_estimates(records, space.schedules, setup.shape, setup.lengths)
    passing = sorted((r for r in rows if r["est_agreement"] >= args.target_agreement),
                     key=lambda r: (-r["est_flop_ideal"][setup.longest],
                                    -sum(r["est_flop_ideal"].values())))
    print(f"offline: {len(space.schedules)} schedules on {len(records)} cases in {seconds:.0f} s; "
          f"{len(passing)} meet the target by estimate", flush=True)
    # Nothing meets the target by estimate: confirm the closest.
    to_confirm = (passing[:args.confirm]
                  or sorted(rows, key=lambda r: -r["est_agreement"])[:args.confirm])
    default_row = summarize_estimates(records, [space.default], setup.shape, setup.lengths)[0]
    return Estimates(records=records, rows=rows, default_row=default_row, passing=passing,
                     to_confirm=to_confirm, seconds=seconds)


def confirm(setup: Setup, space: SearchSpace, est: Estimates) -> Confirmation:
    """The generation step: confirm the candidates, choose one, and measure it (and, with
    --compare-default, the default schedule) on the held-out cases."""
    t0 = time.perf_counter()
    # Calibration cases: the offline pass's greedy answer is the dense reference.
    dense = {r["case"].name: {"case": r["case"].name, "text": r["hf_dense_text"],
                              "correct": r["hf_dense_correct"]} for r in est.records}
    engines = EngineSwitcher(setup.model_path, setup.engine_kwargs)
    try:
        confirm_candidates(setup, engines, est.to_confirm, dense)
        confirmed = [r for r in est.to_confirm if "confirmed" in r]
        best = choose_schedule(confirmed, setup.args.target_agreement, setup.longest)
        best["tag"] = " **chosen**"
        engine = engines.use(best["schedule"])
        for c in _progress_bar(setup.heldout, "dense (held-out)", setup.progress):
            if c.name not in dense:
                dense[c.name] = {"case": c.name, **generate(engine, c, DENSE)}
        heldout = heldout_summary(setup, engine, best["schedule"], dense, "held-out")
        default_heldout = None
        if setup.args.compare_default:
            default_heldout = heldout_summary(setup, engines.use(space.default), space.default,
                                              dense, "default schedule, held-out")
    finally:
        engines.shutdown()
    return Confirmation(confirmed=confirmed, best=best, heldout=heldout,
                        default_heldout=default_heldout, engines_started=engines.started,
                        seconds=time.perf_counter() - t0)


def profile_json(setup: Setup, space: SearchSpace, est: Estimates, conf: Confirmation,
                 png: str, frontier_png: str, duration: float) -> dict:
    args, shape, best = setup.args, setup.shape, conf.best
    return {
        "format": PROFILE_FORMAT,
        "model": {"name": Path(setup.model_path).name, "architecture": shape.architecture,
                  "num_layers": shape.num_layers, "hidden_size": shape.hidden_size},
        "schedule": {**_schedule_json(best["schedule"]),
                     **({"neighbor_blocks": args.neighbor_blocks} if args.neighbor_blocks else {}),
                     **({"sink_tokens": args.sink_tokens}
                        if args.sink_tokens != DEFAULT_SINK_TOKENS else {}),
                     **({"last_queries": args.last_queries}
                        if args.last_queries != DEFAULT_LAST_QUERIES else {})},
        "agreement": {"target": args.target_agreement,
                      "calibration": _agreement_json(best["confirmed"]),
                      "heldout": _agreement_json(conf.heldout)},
        "kept_fractions": conf.heldout["kept_fractions"],
        "flop_ideal_speedup": conf.heldout["flop_ideal_speedup"],
        "calibration_kept_fractions": best["confirmed"]["kept_fractions"],
        "calibration_flop_ideal_speedup": best["confirmed"]["flop_ideal_speedup"],
        "estimate": _estimate_json(best),
        "default_schedule": {**_schedule_json(space.default),
                             "estimate": _estimate_json(est.default_row),
                             "heldout": conf.default_heldout},
        "confirmed_candidates": [{**_schedule_json(r["schedule"]), "estimate": _estimate_json(r),
                                  "calibration": {k: r["confirmed"][k] for k in (
                                      "agree", "dense_correct", "agreement", "stopped_early",
                                      "kept_fractions", "flop_ideal_speedup")}}
                                 for r in conf.confirmed],
        "cases": {"tasks": setup.tasks, "lengths": setup.lengths,
                  "calibration": {"seeds": _ints(args.seeds), "depths": _floats(args.depths),
                                  "tasks": setup.tasks, "haystacks": setup.haystacks,
                                  "names": [c.name for c in setup.calibration]},
                  "heldout": {"seeds": _ints(args.heldout_seeds),
                              "depths": _floats(args.heldout_depths),
                              "tasks": setup.heldout_tasks,
                              "haystacks": setup.heldout_haystacks,
                              "families_unseen_in_calibration": unseen_families(
                                  setup.calibration, setup.heldout),
                              "names": [c.name for c in setup.heldout]},
                  "dense_reference": {"calibration": "offline pass (transformers, float32)",
                                      "heldout": "the SGLang engine, UniPrefill off"}},
        "search": {"schedules": len(space.schedules),
                   "layer_sets": [list(l) for l in space.layer_sets],
                   "top_p": _floats(args.top_p), "block_sizes": _ints(args.block_sizes),
                   "later_top_p": _floats(args.later_top_p) if args.later_top_p else [],
                   "meeting_target_by_estimate": len(est.passing), "confirmed": len(conf.confirmed),
                   "engines_started": conf.engines_started},
        "timing_s": {"total": round(duration, 1), "offline": round(est.seconds, 1),
                     "confirmation": round(conf.seconds, 1)},
        "heatmap": os.path.basename(png),
        "frontier": {"plot": os.path.basename(frontier_png),
                     "pareto_front": [{**_schedule_json(r["schedule"]), **_estimate_json(r)}
                                      for r in pareto_front(est.rows, setup.longest)]},
        "command": setup.command,
        "date": setup.started.date().isoformat(),
        "commit": _git_commit(),
    }


def write_estimates(setup: Setup, est: Estimates, out: Path) -> dict:
    """--offline-only: the replay's figures for every candidate, best estimated saving at the
    longest length first, and per calibration case which candidates keep its needle."""
    rows = sorted(est.rows, key=lambda r: -r["est_flop_ideal"][setup.longest])
    print(table(rows, setup.lengths))
    result = {
        "format": "uniprefill-replay/1",
        "model": Path(setup.model_path).name,
        "neighbor_blocks": setup.args.neighbor_blocks,
        "candidates": [{**_schedule_json(r["schedule"]), "estimate": _estimate_json(r)}
                       for r in rows],
        "cases": [{"case": r["case"].name, "dense_correct": r["hf_dense_correct"],
                   "needle_kept": {s.name: v["needle_kept"] for s, v in r["schedules"].items()},
                   "kept": {s.name: v["kept"] for s, v in r["schedules"].items()}}
                  for r in est.records],
        "timing_s": {"offline": round(est.seconds, 1)},
        "command": setup.command, "date": setup.started.date().isoformat(),
        "commit": _git_commit()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result) + "\n")
    print(f"wrote {out} (offline only, {est.seconds / 60:.1f} min)")
    return result


def print_report(setup: Setup, space: SearchSpace, est: Estimates, conf: Confirmation,
                 out: Path, png: str, duration: float) -> None:
    shown = sorted(conf.confirmed, key=lambda r: -r["est_flop_ideal"][setup.longest])
    print(table([*shown, {**est.default_row, "tag": " (default)"}], setup.lengths))
    best, ho = conf.best, conf.heldout
    print(f"chosen: {best['schedule'].name}; calibration {best['confirmed']['agree']}/"
          f"{best['confirmed']['dense_correct']}, held-out {ho['agree']}/{ho['dense_correct']}"
          f" (target {setup.args.target_agreement:g}); FLOP-ideal on held-out "
          + _speedups(ho))
    if conf.default_heldout:
        print(f"default {space.default.name}: held-out {conf.default_heldout['agree']}/"
              f"{conf.default_heldout['dense_correct']}; FLOP-ideal "
              + _speedups(conf.default_heldout))
    print(f"wrote {out} and {png} in {duration / 60:.1f} min "
          f"(offline {est.seconds / 60:.1f}, confirmation {conf.seconds / 60:.1f})")


def main(argv=None) -> dict:
    args = parse_args(argv)
    argv_list = list(sys.argv[1:] if argv is None else argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    t_start = time.perf_counter()
    setup = prepare_run(args, argv_list, started)
    print(f"{setup.shape.architecture}, {setup.shape.num_layers} layers, hidden "
          f"{setup.shape.hidden_size}: {len(setup.calibration)} calibration and "
          f"{len(setup.heldout)} held-out cases", flush=True)
    space = search_space(args, setup.shape)
    est = estimate(setup, space)
    if args.offline_only:
        return write_estimates(setup, est, Path(args.out))
    conf = confirm(setup, space, est)
    duration = time.perf_counter() - t_start

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = heatmap(est.records, space.heatmap_layers, setup.lengths, str(out.with_suffix(".png")),
                  f"{Path(setup.model_path).name}: single drop per layer", _floats(args.top_p))
    frontier_png = frontier_plot(est.rows, est.default_row, conf.best, setup.longest,
                                 str(out.with_suffix(".frontier.png")),
                                 f"{Path(setup.model_path).name}: accuracy against speed")
    profile = profile_json(setup, space, est, conf, png, frontier_png, duration)
    out.write_text(json.dumps(profile, indent=1) + "\n")
    print_report(setup, space, est, conf, out, f"{png}, {frontier_png}", duration)
    return profile


if __name__ == "__main__":
    main()

"""`ServerArgs` with the UniPrefill flags.

SGLang derives its CLI (`python -m sglang.launch_server --help`) and `sglang.Engine(**kwargs)`
from the fields of `ServerArgs` (a dataclass on SGLang 0.5.17, a msgspec Struct on 0.5.23), so
adding annotated fields in a subclass, and putting the subclass in place of
`sglang.srt.server_args.ServerArgs` (patches/server_args.py), is all it takes for both entry
points to accept them. The flags are checked around SGLang's resolution of the args, wherever
the release runs it (`versions.resolves_when_built`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from sglang.srt.arg_groups.arg_utils import A, Arg
from sglang.srt.server_args import ServerArgs

from uniprefill_sglang import architectures as arch_table
from uniprefill_sglang import environ, versions
from uniprefill_sglang.architectures import lookup as architecture_entry
from uniprefill_sglang.config import (
    BLOCK_SPARSE_ATTENTION_BACKENDS,
    BLOCK_SPARSE_ESTIMATES,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_BLOCK_SPARSE_BLOCK_SIZE,
    DEFAULT_BLOCK_SPARSE_ESTIMATE,
    DEFAULT_BLOCK_SPARSE_MIN_TOKENS,
    DEFAULT_KV_LAYOUT,
    DEFAULT_LAST_QUERIES,
    DEFAULT_PREFIX_POLICY,
    DEFAULT_SINK_TOKENS,
    KV_LAYOUTS,
    PREFIX_POLICIES,
    SUPPORTED_ATTENTION_BACKENDS,
    UniPrefillConfig,
    UniPrefillConfigError,
    attention_backend_names,
    build_config,
    find_shipped_profile,
    load_profile,
)
from uniprefill_sglang.schedule import ModelFacts, resolve

logger = logging.getLogger(__name__)


# The cost rule's default on a GPU: below this many new tokens a prefill step's drop does not
# pay for itself (benchmarks/results/defaults/README.md, "The defaults").
GPU_MIN_STEP_TOKENS = 3072

# Block-scaled KV caches (packed FP4 or MX values with separate scales).
_UNSUPPORTED_KV_CACHE_DTYPES = ("mxfp8", "nvfp4", "fp4_mx_block16", "fp4_e2m1")


def _on_cuda(device) -> bool:
    if device is not None:
        return device == "cuda"
    import torch

    return torch.cuda.is_available()


def _sglangs_attention_backend(server_args) -> Optional[str]:
    """The attention backend SGLang picks given none (None: its rule needs what these args
    cannot give yet)."""
    try:
        return versions.default_attention_backend(server_args)
    except Exception as e:
        logger.info("UniPrefill: SGLang's default attention backend unknown (%s)", e)
        return None


@versions.seal_server_args
class UniPrefillServerArgs(ServerArgs):
    enable_uniprefill: A[
        bool,
        Arg(
            help="UniPrefill: drop low-attention prompt tokens at chosen layers during prefill.",
            action="store_true",
        ),
    ] = False
    uniprefill_top_p: A[
        Optional[str],
        Arg(help="UniPrefill: attention mass of blocks to keep at each drop, in (0, 1] (default 0.99; Gemma 3: 0.975); "
                 "a comma-separated list gives one per drop layer (the last repeats)."),
    ] = None
    uniprefill_keep_ratio: A[
        Optional[str],
        Arg(help="UniPrefill: keep this fraction of blocks at each drop instead of top-p, in (0, 1]; "
                 "a comma-separated list gives one per drop layer (the last repeats)."),
    ] = None
    uniprefill_block_size: A[
        Optional[int],
        Arg(help=f"UniPrefill: tokens per scored block (a power of two; default {DEFAULT_BLOCK_SIZE}).")
    ] = None
    uniprefill_sink_tokens: A[
        Optional[int],
        Arg(help="UniPrefill: the first N prompt tokens are always kept (unset: the profile's, "
                 f"else {DEFAULT_SINK_TOKENS}).")
    ] = None
    uniprefill_last_queries: A[
        Optional[int],
        Arg(help="UniPrefill: score with the attention of the last N queries; they are always "
                 f"kept (unset: the profile's, else {DEFAULT_LAST_QUERIES})."),
    ] = None
    uniprefill_neighbor_blocks: A[
        Optional[int],
        Arg(help="UniPrefill: at each drop, also keep the blocks on either side "
                 "of each request's N highest-scoring blocks outside the sinks and the last "
                 "window (a needle cut by a block boundary keeps both halves); unset: the "
                 "profile's, else 0 (off)."),
    ] = None
    uniprefill_drop_layers: A[
        Optional[str],
        Arg(help="UniPrefill: comma-separated drop layers, 'none', or unset for the per-architecture default."),
    ] = None
    uniprefill_min_prompt_tokens: A[
        Optional[int],
        Arg(help="UniPrefill's cost rule: a prefill step whose new tokens (with the rows its "
                 "earlier chunks parked; a cached prefix counts only where it may be "
                 "re-selected) are fewer runs as stock SGLang, CUDA graph included. Default: "
                 f"{GPU_MIN_STEP_TOKENS} on a GPU (the break-even measured on an H200), 0 on "
                 "the CPU.")
    ] = None
    uniprefill_max_parked_tokens: A[
        Optional[int],
        Arg(help="UniPrefill chunked prefill: the most prompt tokens whose hidden state is parked "
                 "between chunks so the final chunk's queries score them; longer prompts drop "
                 "within the final chunk only. Default: the context length (on a GPU the free "
                 "memory bounds it too). 0 disables parking."),
    ] = None
    uniprefill_profile: A[
        Optional[str],
        Arg(help="UniPrefill: a profile JSON written by `python -m uniprefill_sglang.tools.calibrate`; "
                 "it sets the drop layers, top-p and block size that no flag sets. Unset: the "
                 "profile shipped for the model's architecture, depth and hidden size, if any; "
                 "'none': no profile."),
    ] = None

    uniprefill_prefix_policy: A[
        str,
        Arg(help="UniPrefill with the radix cache: what a request that hits a cached prefix does "
                 "with the tokens the first request's selection dropped. 'verify' (default): "
                 "score the prefix with the new question at the first drop layer and re-select "
                 "when the cached survivors miss what it needs; 'reselect': always select anew; "
                 "'reuse-sparse': reuse the cached selection; 'dense-prefix': as reuse-sparse, "
                 "but a request generating nothing (a prefix being cached) runs dense. verify "
                 "and reselect keep each KV slot's residual stream and query at the first drop "
                 "layer, counted when the KV pool is sized.",
                 choices=list(PREFIX_POLICIES)),
    ] = DEFAULT_PREFIX_POLICY
    uniprefill_kv_layout: A[
        str,
        Arg(help="UniPrefill KV memory: 'staged' gives the layers after each drop layer a KV "
                 "pool of their own that holds slots only for the tokens reaching them, so "
                 "dropped tokens give their memory back; 'shared' keeps one slot per token in "
                 "every layer. Default: staged with --uniprefill-keep-ratio or "
                 "--uniprefill-stage-kv-fraction (pools smaller than the full one), else shared.",
            choices=list(KV_LAYOUTS)),
    ] = DEFAULT_KV_LAYOUT
    uniprefill_prefix_checkpoint: A[
        bool,
        Arg(help="UniPrefill with the radix cache: keep each KV slot's residual stream and query "
                 "at the first drop layer, so that a request can re-select over a cached prefix "
                 "(verify's re-selection, a dense request's restore). It is counted when the KV "
                 "pool is sized (about 11%% fewer tokens on Llama-3.1-8B). Without it, verify "
                 "reuses the cached selection; the reselect policy always keeps it.",
            action="store_true"),
    ] = False
    uniprefill_stage_kv_fraction: A[
        Optional[str],
        Arg(help="UniPrefill staged KV layout: the size of each drop stage's KV pool as a "
                 "fraction of the full pool, in (0, 1]; a comma-separated list gives one per "
                 "stage (the last repeats). Unset: the cumulative --uniprefill-keep-ratio plus "
                 "0.02 headroom, or 1.0 with top-p selection. A request waits when a pool is "
                 "full, so fractions below the real keep profile cost throughput, not answers."),
    ] = None

    uniprefill_max_dropped_mass: A[
        Optional[float],
        Arg(help="UniPrefill: a request whose first drop would let go more than this share of "
                 "the attention mass it scores, in [0, 1], keeps every token from there on (its "
                 "answer is dense's; meta_info says why). Unset: no bound. Per request: "
                 "custom_params uniprefill_max_dropped_mass."),
    ] = None

    uniprefill_block_sparse_density: A[
        Optional[float],
        Arg(help="UniPrefill block-sparse prefill attention: each query block reads this fixed "
                 "fraction of its causal key blocks, in (0, 1] (the sink, local and highest "
                 "estimated blocks; the stand-in random weights need for speed runs). Unset: "
                 "off. Per request: custom_params uniprefill_block_sparse_density."),
    ] = None
    uniprefill_block_sparse_top_p: A[
        Optional[float],
        Arg(help="UniPrefill block-sparse prefill attention: each query block reads the key "
                 "blocks holding this share of its estimated attention mass, in (0, 1]. Unset: "
                 "off. Per request: custom_params uniprefill_block_sparse_top_p."),
    ] = None
    uniprefill_block_sparse_block_size: A[
        Optional[int],
        Arg(help="UniPrefill block-sparse attention: tokens per query and key block (a power "
                 f"of two >= 16; default {DEFAULT_BLOCK_SPARSE_BLOCK_SIZE})."),
    ] = None
    uniprefill_block_sparse_min_tokens: A[
        Optional[int],
        Arg(help="UniPrefill block-sparse attention: a request with fewer keys in a prefill "
                 "step (its prefix and new tokens) attends densely (default "
                 f"{DEFAULT_BLOCK_SPARSE_MIN_TOKENS})."),
    ] = None
    uniprefill_block_sparse_estimate: A[
        str,
        Arg(help="UniPrefill block-sparse attention: what scores the key blocks. 'pooled' "
                 "(default): mean-pooled query and key blocks; 'last_queries': the exact "
                 "attention of the chunk's last --uniprefill-last-queries queries, the same "
                 "blocks kept for every query block (a needle the question reads is not "
                 "diluted by its block's other keys); 'both': the union of the blocks each "
                 "picks. Per request: custom_params uniprefill_block_sparse_estimate.",
            choices=list(BLOCK_SPARSE_ESTIMATES)),
    ] = DEFAULT_BLOCK_SPARSE_ESTIMATE

    def __post_init__(self):
        if versions.resolves_when_built(ServerArgs):
            self._resolve_with_uniprefill(super().__post_init__)
        else:
            super().__post_init__()

    def resolve_once(self):
        """SGLang 0.5.23: the launchers resolve the args here, once (a repeat returns)."""
        if getattr(self, "_resolution_finished", False):
            return super().resolve_once()
        self._resolve_with_uniprefill(super().resolve_once)

    def _resolve_with_uniprefill(self, resolve):
        """Check the flags and fill in UniPrefill's defaults, then let SGLang `resolve`."""
        if not self.enable_uniprefill:
            return resolve()
        if self.uniprefill_min_prompt_tokens is None:
            self.uniprefill_min_prompt_tokens = (
                GPU_MIN_STEP_TOKENS if self.device != "cpu" and _on_cuda(self.device) else 0)
        # Fail before SGLang's (long) resolution pass.
        self.uniprefill_config()
        if self.device == "cpu" and self.attention_backend is None:
            # SGLang picks intel_amx on x86 CPUs; the CPU path of UniPrefill is torch_native.
            self.attention_backend = "torch_native"
        facts = ModelFacts.read(self)
        if _on_cuda(self.device):
            self._choose_gpu_attention_backends(facts)
        # Refuse unservable modes given on the command line before SGLang resolves them ...
        self._check_uniprefill_modes(self)
        # (SGLang's resolution makes the args read-only.)
        self._resolve_uniprefill_profile(facts)
        resolve()
        # ... and again for what SGLang's resolution chose (a page size, a backend).
        resolved = versions.resolved(self)
        self._check_uniprefill_modes(resolved)
        self._check_uniprefill_backend(resolved, facts)
        self._check_uniprefill_model(facts, resolved)

    def _choose_gpu_attention_backends(self, facts: Optional[ModelFacts]):
        """Keep the backend SGLang picks where an adapter serves it. FA3 (SGLang's pick on
        Hopper) serves prefill over the per-stage views for models of full-attention layers
        and for gpt-oss (its sliding-window layers after a drop run the positional kernel);
        decode runs on FlashInfer, whose adapter holds the per-stage decode views and decode
        CUDA graphs (backends/fa3.py), or on Triton for a model SGLang will not serve on
        FlashInfer (gpt-oss). Elsewhere the default is FlashInfer (Triton for such a model). A
        family served on named backends only (DeepSeek's MLA: Triton, FA3 prefill as a preview)
        keeps SGLang's pick: moving it to a backend whose prefill may be slower is the user's
        choice (its requests run dense elsewhere, the reason naming the flag); on FA3 prefill
        it decodes on Triton, whose adapter serves its per-stage decode views."""
        given = (self.attention_backend, self.prefill_attention_backend,
                 self.decode_attention_backend)
        if self.decode_attention_backend == "fa3":
            raise UniPrefillConfigError(
                "--enable-uniprefill does not support --decode-attention-backend fa3: decode "
                "over per-stage KV views runs on flashinfer or triton (FA3 serves prefill)")
        arch = architecture_entry(facts.architectures) if facts is not None else None
        flashinfer = arch is None or arch.flashinfer
        if arch is not None and arch.attention_backends:
            served = arch.served_backends()
            if given == (None, None, None):
                picked = _sglangs_attention_backend(self)
                if picked not in served:
                    logger.info("UniPrefill: %s is served on --attention-backend %s only; "
                                "SGLang's own pick (%s) runs it dense",
                                ", ".join(facts.architectures), " or ".join(sorted(served)),
                                picked)
                    return
                self.attention_backend = picked
            if ("fa3" in served and "fa3" in (self.attention_backend,
                                              self.prefill_attention_backend)
                    and self.decode_attention_backend is None):
                self.decode_attention_backend = "triton"
                logger.info("UniPrefill: prefill attention on fa3, decode on triton")
            return
        if given == (None, None, None):
            plain = facts is not None and set(arch_table.layer_kinds(
                facts.layer_types, facts.num_layers)) == {arch_table.FULL_ATTENTION}
            picked = _sglangs_attention_backend(self)
            if picked == "fa3" and (plain or not flashinfer):
                self.attention_backend = "fa3"
            else:
                self.attention_backend = "flashinfer" if flashinfer else "triton"
        if "fa3" in (self.attention_backend, self.prefill_attention_backend) and (
                self.decode_attention_backend is None):
            self.decode_attention_backend = "flashinfer" if flashinfer else "triton"
            logger.info("UniPrefill: prefill attention on fa3, decode on %s",
                        self.decode_attention_backend)
        if arch is not None and not flashinfer and not self.disable_hybrid_swa_memory:
            # The adapters' per-stage views read every layer's KV from one pool; SGLang's
            # separate sliding-window pool (its default for gpt-oss) is not served.
            self.disable_hybrid_swa_memory = True
            logger.info("UniPrefill: one KV pool for every layer (--disable-hybrid-swa-memory): "
                        "the sliding-window layers' KV is kept whole, as the drop's views need")

    def uniprefill_config(self) -> UniPrefillConfig:
        profile = None
        if self.uniprefill_profile and self.uniprefill_profile.strip().lower() != "none":
            profile = load_profile(self.uniprefill_profile)
        return build_config(
            top_p=self.uniprefill_top_p,
            keep_ratio=self.uniprefill_keep_ratio,
            block_size=self.uniprefill_block_size,
            sink_tokens=self.uniprefill_sink_tokens,
            last_queries=self.uniprefill_last_queries,
            neighbor_blocks=self.uniprefill_neighbor_blocks,
            drop_layers=self.uniprefill_drop_layers,
            min_prompt_tokens=self.uniprefill_min_prompt_tokens,
            max_parked_tokens=self.uniprefill_max_parked_tokens,
            profile=profile,
            prefix_policy=self.uniprefill_prefix_policy,
            kv_layout=self.uniprefill_kv_layout,
            stage_kv_fraction=self.uniprefill_stage_kv_fraction,
            prefix_checkpoint=self.uniprefill_prefix_checkpoint,
            max_dropped_mass=self.uniprefill_max_dropped_mass,
            block_sparse_density=self.uniprefill_block_sparse_density,
            block_sparse_top_p=self.uniprefill_block_sparse_top_p,
            block_sparse_block_size=self.uniprefill_block_sparse_block_size,
            block_sparse_min_tokens=self.uniprefill_block_sparse_min_tokens,
            block_sparse_estimate=self.uniprefill_block_sparse_estimate,
        )

    @staticmethod
    def _check_uniprefill_modes(args):
        """Serving modes the plugin cannot serve correctly: refused, never served wrong (read
        from the args as given, then as resolved)."""
        if args.speculative_algorithm is not None:
            raise UniPrefillConfigError(
                "--enable-uniprefill cannot be combined with --speculative-algorithm "
                f"{args.speculative_algorithm}: draft verification does not read per-stage KV"
            )
        if args.enable_dp_attention or getattr(args, "attn_dp_size", 1) > 1:
            raise UniPrefillConfigError(
                "--enable-uniprefill cannot be combined with --enable-dp-attention: data-parallel "
                "attention gathers token counts fixed before the forward, and a drop changes them"
            )
        if args.pp_size > 1:
            raise UniPrefillConfigError(
                "--enable-uniprefill does not support --pp-size > 1: the survivors of a drop "
                "would have to travel between pipeline stages (use --tp-size)"
            )
        for flag, size in (("--attn-cp-size", args.attn_cp_size), ("--dcp-size", args.dcp_size)):
            if size > 1:
                raise UniPrefillConfigError(
                    f"--enable-uniprefill does not support {flag} > 1: a rank holding part of a "
                    "prompt cannot score it with the prompt's last queries"
                )
        if args.disaggregation_mode not in (None, "null"):
            raise UniPrefillConfigError(
                "--enable-uniprefill cannot be combined with --disaggregation-mode "
                f"{args.disaggregation_mode}: after a drop the later layers hold KV for the "
                "survivors only, and which slots are valid per layer is known to the prefill "
                "server alone; the KV transfer to a decode server assumes every layer complete"
            )
        if args.page_size not in (None, 1):
            raise UniPrefillConfigError(
                f"--enable-uniprefill needs --page-size 1, got {args.page_size}: a drop frees and "
                "re-points single KV slots, and the attention adapters address single slots"
            )
        if args.enable_hierarchical_cache:
            raise UniPrefillConfigError(
                "--enable-uniprefill cannot be combined with --enable-hierarchical-cache: the "
                "host copy of a cached prefix does not carry which of its slots hold KV at each "
                "layer after a drop, so a prefix loaded back would be read as complete"
            )
        if args.kv_cache_dtype in _UNSUPPORTED_KV_CACHE_DTYPES:
            raise UniPrefillConfigError(
                f"--enable-uniprefill does not support --kv-cache-dtype {args.kv_cache_dtype}: "
                "block-scaled KV caches store packed values and scales that the drop's scoring "
                "cannot read as keys (supported: auto, bf16/bfloat16, fp8_e4m3, fp8_e5m2)"
            )

    def _check_uniprefill_backend(self, args, facts: Optional[ModelFacts] = None):
        if self.uniprefill_config().block_sparse:
            self._check_block_sparse_backend(args, facts)
        for flag, value in (
            ("--attention-backend", args.attention_backend),
            ("--prefill-attention-backend", args.prefill_attention_backend),
            ("--decode-attention-backend", args.decode_attention_backend),
        ):
            if value is not None and value not in SUPPORTED_ATTENTION_BACKENDS:
                raise UniPrefillConfigError(
                    f"--enable-uniprefill does not support {flag} {value}; "
                    f"supported: {', '.join(SUPPORTED_ATTENTION_BACKENDS)}"
                )

    @staticmethod
    def _check_block_sparse_backend(args, facts: Optional[ModelFacts] = None):
        """Block-sparse attention runs where the prefill backend has a path for it
        (backends/block_sparse.py), over KV kept in the model's dtype, on models without
        multi-head latent attention."""
        arch = architecture_entry(facts.architectures) if facts is not None else None
        if arch is not None and arch.shape.latent_attention:
            raise UniPrefillConfigError(
                "--uniprefill-block-sparse-density / --uniprefill-block-sparse-top-p: "
                f"{', '.join(facts.architectures)}'s multi-head latent attention has no "
                "block-sparse path")
        flag, backend = (("--prefill-attention-backend", args.prefill_attention_backend)
                         if args.prefill_attention_backend else
                         ("--attention-backend", args.attention_backend))
        if backend not in BLOCK_SPARSE_ATTENTION_BACKENDS:
            raise UniPrefillConfigError(
                f"--uniprefill-block-sparse-density / --uniprefill-block-sparse-top-p: the "
                f"prefill attention backend {backend} ({flag}) has no block-sparse path; use "
                f"--attention-backend {' or '.join(BLOCK_SPARSE_ATTENTION_BACKENDS)}")
        if args.kv_cache_dtype not in ("auto", "bf16", "bfloat16"):
            raise UniPrefillConfigError(
                "--uniprefill-block-sparse-density / --uniprefill-block-sparse-top-p need the "
                f"KV cache in the model's dtype, got --kv-cache-dtype {args.kv_cache_dtype}")

    def _check_uniprefill_model(self, facts: Optional[ModelFacts], resolved):
        """Check the drop layers against the model, when its config could be read (the model
        runner resolves the schedule again once the model is built)."""
        if facts is not None:
            resolve(self.uniprefill_config(),
                    dataclasses.replace(facts, attention_backends=frozenset(
                        attention_backend_names(resolved))), resolved)

    def _resolve_uniprefill_profile(self, facts: Optional[ModelFacts]):
        """Pick the shipped profile for this model when none was given (the scheduler processes
        receive these args and load the same file), and say which profile is in use."""
        if facts is None:  # an explicit profile still applies, unchecked
            return
        no_profile = (self.uniprefill_profile or "").strip().lower() == "none"
        architectures = list(facts.architectures)
        self._apply_architecture_prefix_cache(architectures)
        num_layers, hidden_size = facts.num_layers, facts.hidden_size
        if self.uniprefill_profile is None:
            shipped = find_shipped_profile(architectures, num_layers, hidden_size)
            if shipped is not None:
                self.uniprefill_profile = shipped.path
        if no_profile or self.uniprefill_profile is None:
            self._apply_architecture_top_p(architectures)
            return
        profile = load_profile(self.uniprefill_profile)
        if not profile.matches(architectures, num_layers, hidden_size):
            logger.warning(
                "UniPrefill profile %s was calibrated for %s (%s layers, hidden %s), not this "
                "model (%s, %d layers, hidden %d)", profile.path, profile.architecture,
                profile.num_layers, profile.hidden_size, ", ".join(architectures), num_layers,
                hidden_size)
        config = self.uniprefill_config()
        logger.info("UniPrefill profile %s: drop layers %s, %s, block size %d", profile.path,
                    list(config.resolved_drop_layers(num_layers, architectures,
                                                     facts.layer_types)),
                    f"keep ratio {config.keep_ratio}" if config.keep_ratio else f"top-p {list(config.top_p)}",
                    config.block_size)

    def _apply_architecture_prefix_cache(self, architectures):
        """A family whose recurrent state SGLang caches per prefix runs without the radix cache
        (architectures.Architecture.recurrent_state says why), unless
        UNIPREFILL_HYBRID_PREFIX_CACHE keeps it (experimental: `_keep_hybrid_prefix_cache`)."""
        entry = architecture_entry(architectures)
        if entry is None or not entry.recurrent_state or self.disable_radix_cache:
            return
        if environ.HYBRID_PREFIX_CACHE.get():
            self._keep_hybrid_prefix_cache(architectures)
            return
        self.disable_radix_cache = True
        logger.warning("UniPrefill: the radix cache is off for %s: its recurrent state is cached "
                       "per prefix, and prefix reuse over dropped tokens is not built for it",
                       ", ".join(architectures))

    def _keep_hybrid_prefix_cache(self, architectures):
        """SGLang's radix cache for these models (0.5.17: a UnifiedRadixCache with a recurrent
        state component) keeps a request's recurrent state at the end of each step it inserts. Under UniPrefill a later layer's state then covers the survivors the cached
        KV holds, so a request that reuses the prefix continues both consistently. Not with
        the extra-buffer strategies, which snapshot states at positions inside a step (counted
        over every row, while a later layer runs over the survivors): SGLang's no_buffer needs
        the overlap scheduler off, as stock SGLang turns it off there. Not with the prefix
        checkpoint: re-selecting over a cached prefix would need each later layer's state from
        the prompt's start, which the cache does not hold."""
        names = ", ".join(architectures)
        strategy = getattr(self, "mamba_radix_cache_strategy", "no_buffer")
        if strategy not in ("auto", "no_buffer"):
            raise UniPrefillConfigError(
                f"--mamba-radix-cache-strategy {strategy} with "
                f"--enable-uniprefill on {names}: its states are snapshotted inside a step, "
                "where UniPrefill's later layers run over the survivors only (use no_buffer)")
        if self.uniprefill_prefix_checkpoint or self.uniprefill_prefix_policy == "reselect":
            raise UniPrefillConfigError(
                f"--uniprefill-prefix-checkpoint / --uniprefill-prefix-policy reselect on {names} "
                "with its radix cache: re-selecting over a cached prefix needs each later layer's "
                "recurrent state from the prompt's start, which the cache does not keep")
        if strategy == "auto":
            # SGLang's resolution then picks no_buffer, as it does without overlap on any GPU.
            self.disable_overlap_schedule = True
        logger.warning("UniPrefill: the radix cache stays on for %s (%s, experimental): a "
                       "cached prefix is reused with the survivors its first request kept",
                       names, environ.HYBRID_PREFIX_CACHE.name)

    def _apply_architecture_top_p(self, architectures):
        """An architecture's own default top-p (architectures.py) where no flag or profile
        chose how much to keep."""
        entry = architecture_entry(architectures)
        if entry is None or entry.top_p is None:
            return
        if self.uniprefill_top_p is None and self.uniprefill_keep_ratio is None:
            self.uniprefill_top_p = entry.top_p
            logger.info("UniPrefill: top-p %g, %s's default", entry.top_p, ", ".join(architectures))

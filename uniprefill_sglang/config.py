"""UniPrefill knobs: their defaults, the per-architecture drop schedule and start-up validation.

Everything here is plain Python on purpose: the same checks run in the launcher (via the
ServerArgs subclass), in `sglang.Engine` and again in each scheduler process once the model's
depth is known.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Optional, Sequence, Tuple

from uniprefill_sglang import architectures as arch_table
from uniprefill_sglang import environ

# Architectures with a table entry (uniprefill_sglang/architectures.py).
SUPPORTED_ARCHITECTURES = arch_table.SUPPORTED_NAMES

# Attention backends that know how to read per-stage (sparse) KV (uniprefill_sglang/backends/);
# fa3 serves prefill only (its decode runs on another backend: server_args.py).
SUPPORTED_ATTENTION_BACKENDS = ("torch_native", "flashinfer", "triton", "fa3")


def sliding_window_attention_backends() -> Tuple[str, ...]:
    """Those whose adapter also serves sliding-window layers over the survivors (the window
    measured in original positions; FA3 and Triton through `kernels.positional_attention`); on
    the others a model with such layers runs dense."""
    return ("torch_native", "triton", "flashinfer", "fa3")


DEFAULT_TOP_P = 0.99
DEFAULT_BLOCK_SIZE = 64
DEFAULT_SINK_TOKENS = 128
DEFAULT_LAST_QUERIES = 128
# What a request that hits a cached prefix does with the prefix's selection (prefix_reuse.py).
PREFIX_POLICIES = ("verify", "reselect", "reuse-sparse", "dense-prefix")
DEFAULT_PREFIX_POLICY = "verify"
# KV layouts (stage_pools.py): "staged" gives the layers after each drop a pool of their own,
# holding slots for the tokens that reach them; "shared" gives every layer a slot per token.
# Unset, the layout is staged only where its pools are smaller than the full one (fixed keep
# ratios or explicit stage fractions): under top-p every stage pool is full-size, and the
# staged layout would cost view work for no memory.
KV_LAYOUTS = ("staged", "shared")
DEFAULT_KV_LAYOUT = None
# Block-sparse prefill attention (backends/block_sparse.py): key blocks of this many tokens, and
# requests with fewer keys in a step (prefix and new tokens) attend densely.
DEFAULT_BLOCK_SPARSE_BLOCK_SIZE = 64
DEFAULT_BLOCK_SPARSE_MIN_TOKENS = 1024
# Which estimate scores the key blocks (kernels.block_mask_reference): mean-pooled blocks, the
# exact attention of the chunk's last --uniprefill-last-queries queries, or the union of both.
BLOCK_SPARSE_ESTIMATES = ("pooled", "last_queries", "both")
DEFAULT_BLOCK_SPARSE_ESTIMATE = "pooled"
# The prefill attention backends with a block-sparse path (FlashInfer has none yet).
BLOCK_SPARSE_ATTENTION_BACKENDS = ("torch_native", "triton", "fa3")


# Profiles written by `python -m uniprefill_sglang.tools.calibrate` for the models we calibrated.
SHIPPED_PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


class UniPrefillConfigError(ValueError):
    """An invalid UniPrefill knob; the message names the flag and the valid range."""


@dataclasses.dataclass(frozen=True)
class Profile:
    """The schedule of a calibration profile and the model it was calibrated for."""
    path: str
    drop_layers: tuple[int, ...]
    top_p: tuple[float, ...]  # one per drop (the last repeats)
    block_size: int
    architecture: Optional[str] = None
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    # The bound of --uniprefill-max-dropped-mass calibrated with this top-p (None: none).
    max_dropped_mass: Optional[float] = None
    # --uniprefill-neighbor-blocks where no flag sets it (None: the default, 0).
    neighbor_blocks: Optional[int] = None
    # --uniprefill-sink-tokens and --uniprefill-last-queries where no flag sets them (None: the
    # defaults): the sinks and the scoring window the schedule was calibrated with.
    sink_tokens: Optional[int] = None
    last_queries: Optional[int] = None

    def matches(self, architectures: Sequence[str], num_layers: int, hidden_size: int) -> bool:
        return (self.architecture in architectures and self.num_layers == num_layers
                and self.hidden_size == hidden_size)


@functools.lru_cache(maxsize=16)
def load_profile(path: str) -> Profile:
    """Read a profile JSON (see uniprefill_sglang/tools/calibrate.py). Raises UniPrefillConfigError."""
    try:
        data = json.loads(Path(path).read_text())
        schedule, model = data["schedule"], data.get("model", {})
        return Profile(path=str(path), drop_layers=tuple(int(l) for l in schedule["drop_layers"]),
                       top_p=parse_fractions(schedule["top_p"], "the profile's top_p"),
                       block_size=int(schedule["block_size"]),
                       architecture=model.get("architecture"), num_layers=model.get("num_layers"),
                       hidden_size=model.get("hidden_size"),
                       max_dropped_mass=_optional_float(schedule.get("max_dropped_mass")),
                       neighbor_blocks=_optional_int(schedule.get("neighbor_blocks")),
                       sink_tokens=_optional_int(schedule.get("sink_tokens")),
                       last_queries=_optional_int(schedule.get("last_queries")))
    except (OSError, ValueError, KeyError, TypeError, UniPrefillConfigError) as e:
        raise UniPrefillConfigError(
            f"--uniprefill-profile {path}: not a readable UniPrefill profile ({e!r})") from None


def _optional_float(value) -> Optional[float]:
    return None if value is None else float(value)


def _optional_int(value) -> Optional[int]:
    return None if value is None else int(value)


def find_shipped_profile(architectures: Sequence[str], num_layers: int, hidden_size: int,
                         profile_dir: Path = SHIPPED_PROFILE_DIR) -> Optional[Profile]:
    """The shipped profile calibrated for this architecture, depth and hidden size, if any."""
    for path in sorted(Path(profile_dir).glob("*.json")):
        profile = load_profile(str(path))
        if profile.matches(architectures, num_layers, hidden_size):
            return profile
    return None


def default_drop_layers(num_layers: int) -> tuple[int, ...]:
    """The reference schedule scaled to `num_layers` (7/32, 11/32, ... 27/32 of the depth)."""
    return arch_table.scaled_reference_layers(num_layers)


def is_number(value) -> bool:
    """An int or a float, not a bool (JSON's true is not a 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def fractions_per_drop(value, name: str, error: type = UniPrefillConfigError,
                       show=repr) -> tuple[float, ...]:
    """One fraction in (0, 1] per drop layer (the last repeats), from a number, a non-empty list
    or a comma-separated string, as the top-p, keep-ratio and stage-KV flags and the per-request
    knobs take them. A bad value raises `error` naming `name` (and the item's index inside a
    list) and the value as `show` renders it. Booleans are not numbers (true is not a top-p of
    1); NaN and infinities are out of range."""
    if isinstance(value, str):
        parts = [p for p in value.replace(" ", "").split(",") if p]
        try:
            items = [float(p) for p in parts]
        except ValueError:
            raise error(f"{name} must be a fraction in (0, 1] or a comma-separated list of them, "
                        f"got {show(value)}") from None
        indexed = len(items) > 1
    elif isinstance(value, (list, tuple)):
        items, indexed = list(value), True
    else:
        items, indexed = [value], False
    if not items:
        raise error(f"{name} must be a fraction in (0, 1] or a non-empty list of them, "
                    f"got {show(value)}")
    fractions = []
    for i, item in enumerate(items):
        where = f"{name}[{i}]" if indexed else name
        if not is_number(item):
            raise error(f"{where} must be a number in (0, 1], got {show(item)}")
        if not (math.isfinite(item) and 0.0 < item <= 1.0):
            raise error(f"{where} must be in (0, 1], got {show(float(item))}")
        fractions.append(float(item))
    return tuple(fractions)


def parse_fractions(value, flag: str) -> Optional[tuple[float, ...]]:
    """`fractions_per_drop` for a start-up flag or a profile field; None stays None (unset)."""
    return None if value is None else fractions_per_drop(value, flag)


def parse_drop_layers(value) -> Optional[tuple[int, ...]]:
    """Accept None, "", "none", "7,11,15" or a sequence of ints."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "default", "auto"):
            return None
        if text == "none":
            return ()
        try:
            return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
        except ValueError:
            raise UniPrefillConfigError(
                f"--uniprefill-drop-layers must be a comma-separated list of layer indices "
                f"(e.g. 7,11,15) or 'none', got {value!r}"
            ) from None
    return tuple(int(x) for x in value)


@dataclasses.dataclass(frozen=True)
class UniPrefillConfig:
    # Attention mass kept at each drop, one per drop layer (the last repeats).
    top_p: tuple[float, ...] = (DEFAULT_TOP_P,)
    # One fraction per drop layer (the last repeats); None: select by top-p.
    keep_ratio: Optional[tuple[float, ...]] = None
    block_size: int = DEFAULT_BLOCK_SIZE
    sink_tokens: int = DEFAULT_SINK_TOKENS
    last_queries: int = DEFAULT_LAST_QUERIES
    # Blocks next to each request's N highest-scoring blocks are kept too (selection.py); 0: off.
    neighbor_blocks: int = 0
    # None: the per-architecture default, resolved once the depth is known.
    drop_layers: Optional[tuple[int, ...]] = None
    min_prompt_tokens: int = 0
    # Most tokens parked between the chunks of a chunked prefill (parking.py), 2 vectors of
    # hidden_size each (Llama-3.1-8B, bf16: 16 KiB a token, 2 GiB at 128K tokens); None: the
    # longest prompt the server holds (runtime.py), the device memory bounding it on a GPU.
    max_parked_tokens: Optional[int] = None
    # The profile that supplied the knobs no flag set (None: none).
    profile: Optional[str] = None
    prefix_policy: str = DEFAULT_PREFIX_POLICY
    kv_layout: str = "shared"
    # Keep each KV slot's first-drop residual stream and query (prefix_checkpoint.py) so that a
    # request can re-select over a cached prefix; costs KV capacity (16 KiB per 128 KiB slot on
    # Llama-3.1-8B), so only on request, or under the reselect policy, which needs it.
    prefix_checkpoint: bool = False
    # Per drop stage, the fraction of the full KV pool its pool holds (the last repeats);
    # None: from the fixed keep ratios (stage_pools.default_stage_fractions).
    stage_kv_fraction: Optional[tuple[float, ...]] = None
    # A request whose first drop would let go more than this share of its scored attention
    # mass keeps every token at every drop (drop.py); None: no bound.
    max_dropped_mass: Optional[float] = None
    # The bound is the profile's, calibrated with its top-p: a request that selects otherwise
    # (its own top-p or keep ratio) is not held to it.
    bound_from_profile: bool = False
    # Block-sparse prefill attention, off unless one of density (a fixed fraction of each query
    # block's causal key blocks) and top-p (the estimated mass to keep) is set.
    block_sparse_density: Optional[float] = None
    block_sparse_top_p: Optional[float] = None
    block_sparse_block_size: int = DEFAULT_BLOCK_SPARSE_BLOCK_SIZE
    block_sparse_min_tokens: int = DEFAULT_BLOCK_SPARSE_MIN_TOKENS
    block_sparse_estimate: str = DEFAULT_BLOCK_SPARSE_ESTIMATE

    @property
    def block_sparse(self) -> bool:
        return self.block_sparse_density is not None or self.block_sparse_top_p is not None

    def top_p_at(self, drop_index: int) -> float:
        return per_drop(self.top_p, drop_index)

    @property
    def min_tokens_to_drop(self) -> int:
        """Below this many new tokens a step runs dense (the method needs sinks + last window)."""
        return max(self.min_prompt_tokens, self.sink_tokens + self.last_queries)

    def resolved_drop_layers(self, num_layers: int, architectures: Sequence[str] = (),
                             layer_types: Optional[Sequence[str]] = None) -> tuple[int, ...]:
        """The drop layers: the flag's or profile's, else the architecture's default."""
        if self.drop_layers is not None:
            return self.drop_layers
        entry = arch_table.lookup(architectures)
        if entry is None:
            return default_drop_layers(num_layers)
        return entry.default_drop_layers(
            num_layers, arch_table.full_attention_layers(layer_types, num_layers))


def per_drop(values: Sequence[float], drop_index: int) -> float:
    """The value of a one-per-drop list at the given drop (the last repeats)."""
    return values[min(drop_index, len(values) - 1)]


def one_or_list(values: Sequence[float]):
    """A one-per-drop list as a profile, a knob and the server state carry it: a number when
    one value serves every drop."""
    return values[0] if len(values) == 1 else list(values)


def build_config(
    *,
    top_p,
    keep_ratio,
    block_size: Optional[int],
    sink_tokens: Optional[int],
    last_queries: Optional[int],
    drop_layers,
    min_prompt_tokens: int,
    max_parked_tokens: Optional[int] = None,
    profile: Optional[Profile] = None,
    prefix_policy: str = DEFAULT_PREFIX_POLICY,
    kv_layout: Optional[str] = DEFAULT_KV_LAYOUT,
    stage_kv_fraction=None,
    prefix_checkpoint: bool = False,
    max_dropped_mass: Optional[float] = None,
    neighbor_blocks: Optional[int] = None,
    block_sparse_density: Optional[float] = None,
    block_sparse_top_p: Optional[float] = None,
    block_sparse_block_size: Optional[int] = None,
    block_sparse_min_tokens: Optional[int] = None,
    block_sparse_estimate: Optional[str] = None,
) -> UniPrefillConfig:
    """Validate the raw flag values and build the config. Raises UniPrefillConfigError.

    A ``profile`` supplies the schedule's knobs that no flag sets (None means unset; a keep
    ratio replaces the profile's top-p), and its dropped-mass bound where its top-p applies and
    no flag sets one."""
    knobs = dict(drop_layers=drop_layers, top_p=top_p, block_size=block_size,
                 neighbor_blocks=neighbor_blocks, sink_tokens=sink_tokens,
                 last_queries=last_queries, max_dropped_mass=max_dropped_mass)
    bound_from_profile = profile is not None and _fill_from_profile(profile, knobs, keep_ratio)
    drop_layers, top_p, max_dropped_mass = (knobs["drop_layers"], knobs["top_p"],
                                            knobs["max_dropped_mass"])
    block_size = _or_default(knobs["block_size"], DEFAULT_BLOCK_SIZE)
    neighbor_blocks = _or_default(knobs["neighbor_blocks"], 0)
    sink_tokens = _or_default(knobs["sink_tokens"], DEFAULT_SINK_TOKENS)
    last_queries = _or_default(knobs["last_queries"], DEFAULT_LAST_QUERIES)
    top_ps, keep_ratios = _parse_selection(top_p, keep_ratio, block_size)
    _check_minimum("--uniprefill-sink-tokens", sink_tokens, 0)
    _check_minimum("--uniprefill-last-queries", last_queries, 1)
    _check_minimum("--uniprefill-neighbor-blocks", neighbor_blocks, 0)
    _check_minimum("--uniprefill-min-prompt-tokens", min_prompt_tokens, 0)
    if max_parked_tokens is not None:
        _check_minimum("--uniprefill-max-parked-tokens", max_parked_tokens, 0,
                       " (0 disables parking)")
    _check_choice("--uniprefill-prefix-policy", prefix_policy, PREFIX_POLICIES)
    fractions = parse_fractions(stage_kv_fraction, "--uniprefill-stage-kv-fraction")
    if kv_layout is None:
        smaller = fractions is not None or keep_ratios is not None
        kv_layout = "staged" if smaller else "shared"
    _check_choice("--uniprefill-kv-layout", kv_layout, KV_LAYOUTS)
    layers = _parse_increasing_drop_layers(drop_layers)
    if max_dropped_mass is not None and not (0.0 <= max_dropped_mass <= 1.0):
        raise UniPrefillConfigError(
            "--uniprefill-max-dropped-mass must be in [0, 1] (the share of a request's attention "
            f"mass its first drop may let go), got {max_dropped_mass}")
    sparse = _parse_block_sparse(block_sparse_density, block_sparse_top_p,
                                 block_sparse_block_size, block_sparse_min_tokens,
                                 block_sparse_estimate)
    return UniPrefillConfig(
        top_p=top_ps or (DEFAULT_TOP_P,),
        keep_ratio=keep_ratios,
        block_size=int(block_size),
        sink_tokens=int(sink_tokens),
        last_queries=int(last_queries),
        neighbor_blocks=int(neighbor_blocks),
        drop_layers=layers,
        min_prompt_tokens=int(min_prompt_tokens),
        max_parked_tokens=None if max_parked_tokens is None else int(max_parked_tokens),
        profile=None if profile is None else profile.path,
        prefix_policy=prefix_policy,
        kv_layout=kv_layout,
        stage_kv_fraction=fractions,
        prefix_checkpoint=bool(prefix_checkpoint) or prefix_policy == "reselect",
        max_dropped_mass=None if max_dropped_mass is None else float(max_dropped_mass),
        bound_from_profile=bound_from_profile,
        **sparse,
    )


def _parse_block_sparse(density, top_p, block_size, min_tokens, estimate=None) -> dict:
    """The block-sparse attention fields of the config, checked."""
    if density is not None and top_p is not None:
        raise UniPrefillConfigError(
            "--uniprefill-block-sparse-density and --uniprefill-block-sparse-top-p are mutually "
            "exclusive: set at most one (density keeps a fixed fraction of key blocks, top-p the "
            "blocks holding that estimated attention mass)")
    for flag, value in (("--uniprefill-block-sparse-density", density),
                        ("--uniprefill-block-sparse-top-p", top_p)):
        if value is not None and not (is_number(value) and 0.0 < float(value) <= 1.0):
            raise UniPrefillConfigError(f"{flag} must be in (0, 1], got {value!r}")
    block_size = _or_default(block_size, DEFAULT_BLOCK_SPARSE_BLOCK_SIZE)
    if block_size < 16 or block_size & (block_size - 1):
        raise UniPrefillConfigError(
            "--uniprefill-block-sparse-block-size must be a power of two >= 16 (the Triton "
            f"kernel's smallest query tile), got {block_size}")
    min_tokens = _or_default(min_tokens, DEFAULT_BLOCK_SPARSE_MIN_TOKENS)
    _check_minimum("--uniprefill-block-sparse-min-tokens", min_tokens, 0)
    estimate = _or_default(estimate, DEFAULT_BLOCK_SPARSE_ESTIMATE)
    _check_choice("--uniprefill-block-sparse-estimate", estimate, BLOCK_SPARSE_ESTIMATES)
    return dict(block_sparse_density=None if density is None else float(density),
                block_sparse_top_p=None if top_p is None else float(top_p),
                block_sparse_block_size=int(block_size), block_sparse_min_tokens=int(min_tokens),
                block_sparse_estimate=estimate)


def _fill_from_profile(profile: Profile, knobs: dict, keep_ratio) -> bool:
    """Fill the schedule's unset ``knobs`` (None) from the profile; return whether the
    dropped-mass bound is the profile's. The bound comes only with the profile's top-p, which it
    was calibrated with (a keep ratio or a top-p flag selects otherwise)."""
    if parse_drop_layers(knobs["drop_layers"]) is None:
        knobs["drop_layers"] = profile.drop_layers
    bound_from_profile = False
    if knobs["top_p"] is None and keep_ratio is None:
        knobs["top_p"] = profile.top_p
        if knobs["max_dropped_mass"] is None and profile.max_dropped_mass is not None:
            knobs["max_dropped_mass"], bound_from_profile = profile.max_dropped_mass, True
    for name in ("block_size", "neighbor_blocks", "sink_tokens", "last_queries"):
        if knobs[name] is None:
            knobs[name] = getattr(profile, name)
    return bound_from_profile


def _or_default(value, default):
    return default if value is None else value


def _parse_selection(top_p, keep_ratio, block_size: int):
    """Check how blocks are selected; return the parsed top-p values and keep ratios (None:
    unset)."""
    if top_p is not None and keep_ratio is not None:
        raise UniPrefillConfigError(
            "--uniprefill-top-p and --uniprefill-keep-ratio are mutually exclusive: "
            "set at most one (top-p selects by attention mass, keep-ratio by a fixed budget)"
        )
    top_ps = parse_fractions(top_p, "--uniprefill-top-p")
    keep_ratios = parse_fractions(keep_ratio, "--uniprefill-keep-ratio")
    if block_size < 1 or block_size & (block_size - 1):
        raise UniPrefillConfigError(
            f"--uniprefill-block-size must be a power of two >= 1, got {block_size}"
        )
    return top_ps, keep_ratios


def _check_minimum(flag: str, value: int, minimum: int, note: str = "") -> None:
    if value < minimum:
        raise UniPrefillConfigError(f"{flag} must be >= {minimum}{note}, got {value}")


def _check_choice(flag: str, value, choices: Sequence[str]) -> None:
    if value not in choices:
        raise UniPrefillConfigError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")


def _parse_increasing_drop_layers(value) -> Optional[tuple[int, ...]]:
    """parse_drop_layers, checked: non-negative and strictly increasing."""
    layers = parse_drop_layers(value)
    if layers is None:
        return None
    if any(l < 0 for l in layers):
        raise UniPrefillConfigError(
            f"--uniprefill-drop-layers must be non-negative layer indices, got {list(layers)}"
        )
    if len(set(layers)) != len(layers) or list(layers) != sorted(layers):
        raise UniPrefillConfigError(
            f"--uniprefill-drop-layers must be strictly increasing, got {list(layers)}"
        )
    return layers


def attention_backend_names(server_args) -> set:
    """The attention backends a server runs (prefill and decode may differ); empty while SGLang
    has not chosen one."""
    return {server_args.attention_backend, getattr(server_args, "prefill_attention_backend", None),
            getattr(server_args, "decode_attention_backend", None)} - {None}


def unsupported_architecture_reason(
    architectures: Sequence[str], layer_types: Optional[Sequence[str]] = None,
    attention_backends: Sequence[str] = (),
) -> Optional[str]:
    """Why UniPrefill cannot serve this model (None if it can).

    An architecture needs a table entry (architectures.py), and every layer's attention kind
    (the Hugging Face config's ``layer_types``, where it has one) must be one its entry serves:
    Gemma 3's sliding-window layers are, a Qwen2 configured with sliding-window layers is not
    (its decoder layer keeps the window in SGLang's own way, which the views do not model).
    An entry that names its attention backends (DeepSeek's MLA: Triton) is served on those only.
    """
    names = ", ".join(architectures) or "(none)"
    entry = arch_table.lookup(architectures)
    if entry is None:
        sliding = " (sliding-window hybrid)" if layer_types and any(
            t != arch_table.FULL_ATTENTION for t in layer_types) else ""
        return (f"unsupported architecture {names}{sliding}: no UniPrefill integration "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})")
    kinds = sorted(set(layer_types or ()) - entry.layer_kinds)
    if kinds:
        return (f"unsupported architecture {names}: layers of kind {', '.join(kinds)} "
                f"(its integration serves {', '.join(sorted(entry.layer_kinds))})")
    served = entry.served_backends()
    unserved = sorted(set(attention_backends) - served if served is not None else ())
    if unserved:
        preview = (f"; {', '.join(sorted(entry.preview_backends))} under "
                   f"{environ.PREVIEW_BACKENDS.name}=1 (a preview)"
                   if entry.preview_backends and not entry.preview_backends <= served else "")
        return (f"{names} is served by UniPrefill on the {' and '.join(sorted(served))} "
                f"attention backend only (not {', '.join(unserved)}): --attention-backend "
                f"{' or '.join(sorted(served))}{preview}")
    serving = sliding_window_attention_backends()
    windowless = sorted(set(attention_backends) - set(serving))
    if arch_table.SLIDING_ATTENTION in (layer_types or ()) and windowless:
        return (f"{names} has sliding-window layers, which UniPrefill serves on the "
                f"{' and '.join(serving)} attention backends only "
                f"(not {', '.join(windowless)})")
    return None


def validate_for_model(
    config: UniPrefillConfig,
    architectures: Sequence[str],
    num_layers: int,
    full_attention_layers: Optional[Sequence[int]] = None,
    layer_types: Optional[Sequence[str]] = None,
    attention_backends: Sequence[str] = (),
) -> tuple[int, ...]:
    """Check the drop layers against the model; return the resolved schedule.

    An unsupported architecture (``unsupported_architecture_reason``) gets an empty schedule
    (dense, logged by the caller) unless the user asked for explicit drop layers, which is an
    error.
    """
    reason = unsupported_architecture_reason(architectures, layer_types, attention_backends)
    if reason is not None:
        if config.drop_layers:
            raise UniPrefillConfigError(f"--uniprefill-drop-layers was given but {reason}")
        return ()
    layers = config.resolved_drop_layers(num_layers, architectures, layer_types)
    if full_attention_layers is None and layer_types:
        full_attention_layers = arch_table.full_attention_layers(layer_types, num_layers)
    for l in layers:
        if not (0 <= l < num_layers):
            raise UniPrefillConfigError(
                f"--uniprefill-drop-layers: layer {l} is out of range; the model has "
                f"{num_layers} layers (valid: 0..{num_layers - 1})"
            )
        if full_attention_layers is not None and l not in full_attention_layers:
            raise UniPrefillConfigError(
                f"--uniprefill-drop-layers: layer {l} is not a full-attention layer "
                f"(full-attention layers: {list(full_attention_layers)})"
            )
    return layers

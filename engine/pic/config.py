"""`PicConfig`: the knobs of position-independent caching and of its baselines, one frozen
dataclass shared by the planners; its defaults are the ones every entry point runs
(`kvengine run` and `serve`, the serving benchmark, the quality harness all start from
engine.connector.settings.PicSettings(), which holds a PicConfig()).

Methods (one flag each, all in the same engine):
- `full`: recompute every prompt token (no reuse).
- `prefix`: prefix caching over segment boundaries with state checkpoints (engine.pic.prefix).
- `naive`: splice every cached segment as computed alone; no seam; linear states added
  without their transition operator (S = S_prev + E), the HYPIC "naive addition" baseline.
- `pic`: splice with a seam of `seam` tokens recomputed in context at the head of every
  segment after the first, linear states composed exactly (S = T_tail S_seam + E_tail).

The SWA seam policy (`swa_seam`) decides the seam of models with sliding-window layers:
`"window"` (default) recomputes max(seam, window) tokens, so every token whose SWA window
reaches into the previous segment is recomputed in context; `"seam"` uses `seam` alone.
See docs/pic.md for why.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.pic.errors import PicConfigError

#: PicConfig.idle_batch_tokens' default (engine.pic.deferred reads it from here): on an
#: H200 a packed alone pass of 12 x 1400 tokens costs 1.2x a full prefill per token
#: against 2.0x at 3 x 1400 (fla's per-call host cost spread; docs/BENCHMARKS.md)
IDLE_BATCH_TOKENS = 16384

METHODS = ("full", "prefix", "naive", "pic")
SWA_SEAM_POLICIES = ("window", "seam")
ANCHORS = ("bos", "none")
KERNEL_BACKENDS = ("auto", "torch", "triton")
STATE_DTYPES = ("auto", "float32", "bfloat16", "float16")
SEAM_CHAIN_MODES = ("auto", "on", "off")
PREFIX_CHECKPOINT_POLICIES = ("branch", "every")
#: when the cold fallback takes a request (PicConfig.cold_full_policy)
COLD_FULL_POLICIES = ("fraction", "cost")
#: where a request's uncached segments are computed (PicConfig.miss_path)
MISS_PATHS = ("alone", "context")
#: when a computed exact prefix also goes to the store (PicConfig.exact_prefix_store)
EXACT_PREFIX_STORE = ("reused", "always")
#: which requests queue an idle exact pass over their cacheable prefix (PicConfig.exact_prefix_passes)
EXACT_PREFIX_PASSES = ("all", "repeated")
#: which queued misses an idle alone pass signs (PicConfig.idle_alone_passes)
IDLE_ALONE_PASSES = ("all", "repeated")
#: where the signatures of misses computed in context come from (PicConfig.miss_signatures)
MISS_SIGNATURE_SOURCES = ("alone", "context")
#: how an alone pass on fla gets its scalar/diagonal-decay tails' E_tail (PicConfig.tail_states)
TAIL_STATE_MODES = ("fla", "direct")

DEFAULT_SEAM = 16
DEFAULT_SIGNATURE_CACHE_BYTES = 2 << 30
DEFAULT_PREFIX_CACHE_BYTES = 2 << 30


@dataclass(frozen=True)
class PicConfig:
    """Options of the PIC planner and its baselines.

    method: one of METHODS. seam: tokens recomputed in context at the head of each
    spliced segment after the first (`pic` only). swa_seam: SWA seam policy (module
    docstring). anchor: `"bos"` computes every segment alone behind the tokenizer's BOS
    (the token a prompt starts with), `"none"` alone from position 0 with nothing before
    it. state_dtype: dtype of cached linear states E and dense transition operators
    (composition always runs in float32); `"auto"` (default): the model's dtype when it
    runs in bfloat16 or float16 (half the bytes to store and load; on the tiny models'
    quality suite bf16 states scored exactly as float32 ones, docs/BENCHMARKS.md), else
    float32. Keys of non-float32 signatures carry their dtype, so the two never mix. kernel: `"auto"` runs the Triton kernels on
    CUDA and their torch references on the CPU; `"triton"` forces Triton (the interpreter
    on the CPU); `"torch"` forces the references. signature_cache_bytes /
    prefix_cache_bytes: capacity of the in-process caches. sync_timing: have the engine
    synchronise the device after every plan step (exact time split on a GPU, at a small
    cost; `engine.pic.run.attach_planner` sets `LLMEngine.sync_timings` from it).
    keep_end_state: signatures keep each linear layer's end state E, so a segment that
    starts the prompt is spliced whole (bit-exact, nothing computed); False saves a third
    of the linear bytes and places a first segment like any other (anchor and seam
    computed, tail spliced). fused: run everything after the lookups (seams, splices,
    suffix) as one pass through the layers (engine.pic.fused); False runs one model pass
    per computed range with splice steps between them (same numbers, more overhead).
    seam_chain (fused only): `"auto"` runs each linear layer's recurrences and
    compositions as ONE kernels.seam_chain launch on CUDA (every family; the CPU, dims over
    the kernel's limit and prefix checkpoints take the per-event path); `"on"` always
    uses the chain (Triton per `kernel`, else its torch reference); `"off"` always the
    per-event path.
    cold_full_fraction (`pic`/`naive`): when the segments a request would first have to
    compute alone (its misses) hold at least this fraction of its prompt tokens, the
    request is prefilled by plain full recompute (its TTFT stays that of full recompute
    instead of alone passes + splicing) and its missing segments are queued and computed
    alone later, while the engine is idle (`help_idle`), so later requests hit them.
    None (the default everywhere, docs/pic.md "Settings"): no fallback.
    cold_full_policy (with cold_full_fraction): `"fraction"` (default) falls back at that
    fraction; `"cost"` falls back as soon as the misses hold more than the measured
    break-even share (full / alone cost per token on this engine, engine.pic.costs; at
    most `cold_full_fraction`, which also applies until both costs are measured).
    miss_path (`pic`/`naive`, misses the cold fallback leaves to the request):
    `"context"` (default; fused only) computes them in context inside the request's one
    fused pass, like prefix caching computes what it misses (a full prefill's cost per
    token, not an alone pass's), and queues them for idle-time alone passes
    (`help_idle`), so later requests hit them; `"alone"` computes each uncached segment
    alone in the request (one packed pass), caches it and splices it like a hit (a cold
    request then gives exactly the output of the same request warm; the step-by-step
    plan, fused=False, needs it).
    miss_signatures (with miss_path="context"): `"alone"` (default) queues each miss for
    an idle-time alone pass that computes its signature; `"context"` takes the signature
    from the request's own pass (engine.pic.capture: the tail's K/V and linear parts as
    computed in context; exact for a segment placed first, carrying its context
    otherwise), keeps it once the first token is out (`keep_captured`) and runs no
    alone pass. Keys of such planners carry `;ctx=1`, so their signatures never mix with
    those of alone-only planners.
    idle_resume (`pic`/`naive`): an idle alone pass that gives way to a request is kept
    and resumed by the next idle call (True, default), or dropped and its segments queued
    again (False; for A/B runs).
    idle_alone_passes (`pic`/`naive`, with the cold fallback or miss_path="context" and
    alone signatures): which of the misses a request computed in context are queued for
    an idle-time alone pass. `"all"` (default): every one. `"repeated"`: a segment only
    on its second miss (engine.pic.deferred keeps a bounded record of keys seen), so a
    document a stream names once costs no alone pass (an alone pass costs 2-3x its
    tokens in context); a document named again is hit from its third sighting.
    idle_batch_tokens: tokens one idle alone pass packs at most (default 16384: ~10 ms a
    layer on an H200 for qwen3next-bench); larger packs spread the pass's per-call host
    cost over more tokens, and the pass gives way to an arriving request between layers.
    prefix_checkpoints (`prefix`): where prefix caching keeps linear states (and window
    rows), which a prefix can only be reused up to; full-attention K/V is kept at every
    cacheable segment boundary either way. `"branch"` (default, Marconi / SGLang style):
    at the end of a request's cacheable prefix, and at the boundary where the request
    leaves a path another request already cached (a shared prefix, likely reused
    again); the pass splits its linear recurrences at two points at most and costs what
    full recomputation costs. `"every"`: at every cacheable boundary (any segment prefix
    reusable, one recurrence split per segment: on the GPU this kept prefix caching
    1.0-2.7x slower than full recomputation in a GPU serving run).
    exact_prefix (`pic`): reuse exact prefix states (engine.pic.exact_prefix): a request
    whose leading cached segments match an earlier sequence exactly restores the state at
    the deepest such boundary (no seam, no composition) and plans only the rest; exact
    checkpoints come from cold-fallback passes and from idle-time passes over the
    cacheable prefixes of earlier requests, kept in a prefix tree of
    `prefix_cache_bytes` (True, default). False: every cached segment is spliced.
    exact_prefix_store (`pic` with exact_prefix, over a store that keeps prefixes, e.g.
    the kvstore daemon): when a computed exact prefix also goes to the store. `"reused"`
    (default): once a request restores it from this engine's tree (put while idle), so
    a prompt seen once (most RAG prompts) costs the store no bytes; `"always"`: as soon
    as it is computed (another engine or process finds even a prompt seen once).
    exact_prefix_passes (`pic` with exact_prefix): which requests whose cacheable prefix
    is not exact yet queue an idle-time pass computing it (a whole prompt's prefix: what
    a full prefill of it costs). `"all"` (default): every one. `"repeated"`: only on the
    second sighting of the same cacheable prefix (engine.pic.exact_prefix keeps a bounded
    record of prefixes seen), so a stream of prompts seen once (RAG requests over
    documents in new orders) runs no such pass; an exact repeat is then exact from its
    third sighting, and a chat turn's history is spliced rather than restored (the cold
    fallback's own pass still takes its checkpoints).
    batch_long_ranges (fused, fla): a delta-rule layer with two or more long computed
    ranges (misses computed in context) runs them in two shared varlen calls
    (engine.pic.long_ranges; True, default) instead of one fla call per range (False).
    tail_states (alone passes on fla): E_tail of scalar/diagonal-decay tails from a
    second varlen call over the tails (`"fla"`, default) or as one decay-weighted sum per
    tail (`"direct"`, linear_ops.end_state_from_zero: no second call; same signatures
    within float tolerance). Neither alternative has been timed against the default on a
    GPU (`tools/bench_alone_pass.py --tail-states both`, `tools/check_long_ranges_gpu.py`).
    """

    method: str = "pic"
    seam: int = DEFAULT_SEAM
    swa_seam: str = "window"
    anchor: str = "bos"
    state_dtype: str = "auto"
    kernel: str = "auto"
    signature_cache_bytes: int = DEFAULT_SIGNATURE_CACHE_BYTES
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES
    sync_timing: bool = False
    keep_end_state: bool = True
    fused: bool = True
    seam_chain: str = "auto"
    cold_full_fraction: float | None = None
    cold_full_policy: str = "fraction"
    miss_path: str = "context"
    miss_signatures: str = "alone"
    idle_resume: bool = True
    idle_alone_passes: str = "all"
    idle_batch_tokens: int = IDLE_BATCH_TOKENS
    prefix_checkpoints: str = "branch"
    batch_long_ranges: bool = True
    exact_prefix: bool = True
    exact_prefix_store: str = "reused"
    exact_prefix_passes: str = "all"
    tail_states: str = "fla"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.method not in METHODS:
            raise PicConfigError(f"method={self.method!r} must be one of {', '.join(METHODS)}")
        if not isinstance(self.seam, int) or isinstance(self.seam, bool) or self.seam < 0:
            raise PicConfigError(f"seam={self.seam!r} must be an int >= 0")
        if self.swa_seam not in SWA_SEAM_POLICIES:
            raise PicConfigError(f"swa_seam={self.swa_seam!r} must be one of {', '.join(SWA_SEAM_POLICIES)}")
        if self.anchor not in ANCHORS:
            raise PicConfigError(f"anchor={self.anchor!r} must be one of {', '.join(ANCHORS)}")
        if self.kernel not in KERNEL_BACKENDS:
            raise PicConfigError(f"kernel={self.kernel!r} must be one of {', '.join(KERNEL_BACKENDS)}")
        if self.seam_chain not in SEAM_CHAIN_MODES:
            raise PicConfigError(f"seam_chain={self.seam_chain!r} must be one of {', '.join(SEAM_CHAIN_MODES)}")
        if self.prefix_checkpoints not in PREFIX_CHECKPOINT_POLICIES:
            raise PicConfigError(f"prefix_checkpoints={self.prefix_checkpoints!r} must be one of "
                                 f"{', '.join(PREFIX_CHECKPOINT_POLICIES)}")
        if self.state_dtype not in STATE_DTYPES:
            raise PicConfigError(f"state_dtype={self.state_dtype!r} must be one of {', '.join(STATE_DTYPES)}")
        if self.cold_full_policy not in COLD_FULL_POLICIES:
            raise PicConfigError(f"cold_full_policy={self.cold_full_policy!r} must be one of "
                                 f"{', '.join(COLD_FULL_POLICIES)}")
        if not isinstance(self.idle_resume, bool):
            raise PicConfigError(f"idle_resume={self.idle_resume!r} must be True or False")
        if self.idle_alone_passes not in IDLE_ALONE_PASSES:
            raise PicConfigError(f"idle_alone_passes={self.idle_alone_passes!r} must be one of "
                                 f"{', '.join(IDLE_ALONE_PASSES)}")
        if isinstance(self.idle_batch_tokens, bool) or not isinstance(self.idle_batch_tokens, int) \
                or self.idle_batch_tokens < 1:
            raise PicConfigError(f"idle_batch_tokens={self.idle_batch_tokens!r} must be a positive integer")
        if not isinstance(self.exact_prefix, bool):
            raise PicConfigError(f"exact_prefix={self.exact_prefix!r} must be True or False")
        if self.exact_prefix_store not in EXACT_PREFIX_STORE:
            raise PicConfigError(f"exact_prefix_store={self.exact_prefix_store!r} must be one of "
                                 f"{', '.join(EXACT_PREFIX_STORE)}")
        if self.exact_prefix_passes not in EXACT_PREFIX_PASSES:
            raise PicConfigError(f"exact_prefix_passes={self.exact_prefix_passes!r} must be one of "
                                 f"{', '.join(EXACT_PREFIX_PASSES)}")
        if not isinstance(self.batch_long_ranges, bool):
            raise PicConfigError(f"batch_long_ranges={self.batch_long_ranges!r} must be True or False")
        if self.tail_states not in TAIL_STATE_MODES:
            raise PicConfigError(f"tail_states={self.tail_states!r} must be one of {', '.join(TAIL_STATE_MODES)}")
        if self.miss_path not in MISS_PATHS:
            raise PicConfigError(f"miss_path={self.miss_path!r} must be one of {', '.join(MISS_PATHS)}")
        if self.miss_signatures not in MISS_SIGNATURE_SOURCES:
            raise PicConfigError(f"miss_signatures={self.miss_signatures!r} must be one of "
                                 f"{', '.join(MISS_SIGNATURE_SOURCES)}")
        if self.miss_signatures == "context" and self.miss_path != "context":
            raise PicConfigError("miss_signatures='context' takes signatures from misses computed in context: "
                                 f"it needs miss_path='context', not {self.miss_path!r}")
        if self.miss_path == "context" and not self.fused:
            raise PicConfigError("miss_path='context' computes misses inside the fused pass: it needs fused=True "
                                 "(with fused=False, set miss_path='alone')")
        f = self.cold_full_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f <= 1.0):
            raise PicConfigError(f"cold_full_fraction={f!r} must be None or a number in (0, 1]")
        for name in ("signature_cache_bytes", "prefix_cache_bytes"):
            if getattr(self, name) < 0:
                raise PicConfigError(f"{name}={getattr(self, name)!r} must be >= 0")

    def effective_seam(self, window: int | None) -> int:
        """Seam length of a segment after the first, before clipping to its length: the
        configured seam for `pic` (max with the SWA window under the "window" policy when
        the model has sliding-window layers), 0 for `naive`."""
        if self.method == "naive":
            return 0
        if window and self.swa_seam == "window":
            return max(self.seam, window)
        return self.seam

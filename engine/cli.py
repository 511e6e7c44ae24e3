"""`kvengine`: the engine's command line (typer). Entry point `main`; also runnable as
`python -m engine.cli`. This module holds the app and the small commands (presets,
generate, bench); `run` is engine.cli_run, `index` engine.cli_index, `serve` engine.cli_serve, and the options
they share (one list, `engine.cli_options.pic_options`) engine.cli_options.

    kvengine serve --preset NAME [--host H --port P --device D --dtype T --max-batch N ...]
    kvengine generate --preset NAME "PROMPT" [--max-new-tokens N --temperature T --top-p P --seed S]
    kvengine generate --model DIR "PROMPT" [--chat] --max-new-tokens N --json
    kvengine presets [--json]
    kvengine bench --preset NAME [--num-requests N --prompt-len L --max-new-tokens M --request-rate R --json]
    kvengine run --preset NAME --requests FILE.jsonl --method full|prefix|naive|pic [--seam N] [--max-new-tokens N] [--json] [--store [SOCKET]]
    kvengine serve ... [--store [SOCKET]] [--start-without-store]
    kvengine run|serve ... [--pic-config FILE]
    kvengine index --preset NAME|--model DIR --segments FILE.jsonl --store [SOCKET] [--json]

`--model DIR` (serve, generate, run, bench) runs a Hugging Face checkpoint directory
(engine/models/hf/) with its own tokenizer instead of a `--preset`; exactly one of the two.
`generate --model DIR "PROMPT" --json` takes PROMPT as raw text (tokenized as the
tokenizer does by default; `--chat` renders it through the chat template as one user
message), decodes greedily by default and prints `text`, `token_ids` (the generated ids),
`prompt_tokens` and timings.

`--store [SOCKET]` keeps segment signatures in a kvstore daemon (engine.connector) instead
of the engine's process: given without a value it uses the daemon's default socket
(KVSTORE_SOCKET, the kvstore config file, the per-user path). `main` rewrites a bare
`--store` into `--store=` before typer parses the command line (typer options cannot
have an optional value). The daemon must answer when the command starts (else exit 3,
naming the socket and how to start one), unless `--start-without-store`: then the
engine computes every prompt in full until the daemon answers. `serve` without `--store`
says on stderr that it caches nothing, and refuses `--pic-config` and `--seam`.

PIC and connector settings (miss path, cold fallback, exact prefixes, cold sharing,
timeouts, ...) are one object, engine.connector.settings.PicSettings, with one set of
defaults; `--pic-config FILE` (TOML: [pic] and [store] tables, docs/pic.md "Settings",
docs/examples/pic.toml) changes them, and `--method` / `--seam` given on the command line
win over the file.

These command and option names are an interface that scripts depend on; keep them.
Bad input exits with status 2 and a one-line message "kvengine: error: ..." naming the
option (or the file's line and request id, or the settings file's key); no daemon at
--store: 3; a failure while running: 1.
"""
from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from engine.cli_options import (BudgetOpt, ChunkOpt, DeviceOpt, DtypeOpt, GraphsOpt, HiSparseArgs, HiSparseBlockOpt,
                                HiSparseHotOpt, HiSparseMinOpt, HiSparseOpt, HiSparseStoreOpt, HiSparseTopkOpt,
                                HostThreadsOpt, KvTokensOpt, MaxBatchOpt, ModelOpt, PresetOpt, build, engine_config,
                                fail, fail_field, hisparse_report, hisparse_settings, model_source, note_cache_size,
                                option)
from engine.cli_index import index_cmd
from engine.cli_run import run_cmd
from engine.cli_serve import serve
from engine.errors import ConfigError, EngineError, InvalidRequestError
from kvstore.cli_help import PlainHelpCommand

app = typer.Typer(
    name="kvengine",
    help="Hybrid-attention inference engine: serve, generate, list presets, benchmark.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help (kvstore.cli_help): nothing cut at 80 columns
    context_settings={"max_content_width": 120},
)
app.command("serve", cls=PlainHelpCommand)(serve)
app.command("run", cls=PlainHelpCommand)(run_cmd)
app.command("index", cls=PlainHelpCommand)(index_cmd)

@app.command(cls=PlainHelpCommand)
def presets(as_json: bool = typer.Option(False, "--json", help="Print a JSON list instead of a table.")) -> None:
    """List the model presets: name, family, scale (tiny or bench) and layer pattern."""
    from engine.models.presets import list_presets, preset_info

    rows = [preset_info(cfg) for cfg in list_presets(real_shape=True)]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "family", "scale", "parameters", "layers")
    for r in rows:
        params = r.get("parameters")
        table.add_row(r["name"], r["family"], r["scale"] + (" (real shape)" if r.get("real_shape") else ""),
                      "" if params is None else f"{params / 1e6:,.1f}M",
                      _layer_pattern(r["layers"]))
    Console(width=None if sys.stdout.isatty() else 240).print(table)  # piped: not cut at 80 columns


def _runs(layers: list[str]) -> str:
    out: list[list] = []
    for kind in layers:
        if out and out[-1][0] == kind:
            out[-1][1] += 1
        else:
            out.append([kind, 1])
    return ", ".join(kind if n == 1 else f"{kind} x{n}" for kind, n in out)


def _layer_pattern(layers: list[str]) -> str:
    """Compact form of a layer list: "(gdn x3, full) x6", or runs when not periodic."""
    n = len(layers)
    for period in range(1, n // 2 + 1):
        if n % period == 0 and layers == layers[:period] * (n // period):
            return f"({_runs(layers[:period])}) x{n // period}"
    return _runs(layers)


@app.command(cls=PlainHelpCommand)
def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    preset: Optional[str] = PresetOpt,
    model: Optional[str] = ModelOpt,
    chat: bool = typer.Option(False, "--chat", help="--model: render PROMPT as one user message through the "
                              "checkpoint's chat template (default: PROMPT is raw text)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
    hisparse: bool = HiSparseOpt,
    hisparse_block: int = HiSparseBlockOpt,
    hisparse_topk: int = HiSparseTopkOpt,
    hisparse_hot: int = HiSparseHotOpt,
    hisparse_min_context: int = HiSparseMinOpt,
    hisparse_store: Optional[str] = HiSparseStoreOpt,
) -> None:
    """Generate from one prompt; print the text and its timings."""
    from engine.runtime.sampling import SamplingParams

    source = model_source(preset, model)
    if not prompt:
        fail("PROMPT: must not be empty")
    if chat and model is None:
        fail("--chat: needs --model (presets have no chat template)")
    try:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    except ConfigError as exc:
        fail_field(exc)
    hs = hisparse_settings(HiSparseArgs(hisparse, hisparse_block, hisparse_topk, hisparse_hot, hisparse_min_context,
                                        hisparse_store))
    engine = build(source, engine_config(device, dtype, 1, 2048, 2048, None, None, hisparse=hs))
    if chat:
        try:
            prompt = engine.tokenizer.chat_prompt([{"role": "user", "content": prompt}])
        except EngineError as exc:
            fail(f"--chat: {exc}")
    try:
        (out,) = engine.generate([prompt], params)
    except InvalidRequestError as exc:
        fail(f"{option(exc.field)}: {exc.message}")
    except EngineError as exc:
        fail(str(exc))
    finally:
        if engine.kv_offload is not None:
            engine.kv_offload.close()
    tl = out.timeline
    timings = {
        "prompt_tokens": out.num_prompt_tokens,
        "output_tokens": len(out.token_ids),
        "ttft_ms": round(tl.ttft * 1e3, 3),
        "decode_tokens_per_s": None if tl.decode_tokens_per_s is None else round(tl.decode_tokens_per_s, 2),
        "total_ms": round(tl.e2e * 1e3, 3),
        "finish_reason": out.finish_reason,
    }
    if engine.kv_offload is not None:
        timings["hisparse"] = hisparse_report(engine)
    if as_json:
        typer.echo(json.dumps({"text": out.text, "token_ids": list(out.token_ids), **timings}))
        return
    typer.echo(out.text)
    dtps = "n/a" if timings["decode_tokens_per_s"] is None else f"{timings['decode_tokens_per_s']:.1f}"
    typer.echo(
        f"[prompt tokens: {timings['prompt_tokens']} | output tokens: {timings['output_tokens']} | "
        f"TTFT: {timings['ttft_ms']:.1f} ms | decode: {dtps} tokens/s | finish: {out.finish_reason}]",
        err=True,
    )


@app.command(cls=PlainHelpCommand)
def bench(
    preset: Optional[str] = PresetOpt,
    model: Optional[str] = ModelOpt,
    num_requests: int = typer.Option(16, "--num-requests", min=1),
    prompt_len: int = typer.Option(256, "--prompt-len", min=1),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=1),
    request_rate: Optional[float] = typer.Option(None, "--request-rate", help="Poisson arrivals per second (default: all at once)."),
    seed: int = typer.Option(0, "--seed"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    max_batch: int = MaxBatchOpt,
    max_batched_tokens: int = BudgetOpt,
    chunk_size: int = ChunkOpt,
    kv_cache_tokens: Optional[int] = KvTokensOpt,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    cuda_graphs: bool = GraphsOpt,
    host_threads: Optional[int] = HostThreadsOpt,
    hisparse: bool = HiSparseOpt,
    hisparse_block: int = HiSparseBlockOpt,
    hisparse_topk: int = HiSparseTopkOpt,
    hisparse_hot: int = HiSparseHotOpt,
    hisparse_min_context: int = HiSparseMinOpt,
    hisparse_store: Optional[str] = HiSparseStoreOpt,
) -> None:
    """Synthetic load: N requests of a given prompt length; TTFT p50/p99 and throughput."""
    from engine.bench import LoadSpec, run_load

    source = model_source(preset, model)
    spec = LoadSpec(num_requests=num_requests, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                    request_rate=request_rate, seed=seed)
    try:
        spec.validate()
    except InvalidRequestError as exc:
        fail(f"{option(exc.field)}: {exc.message}")
    hs = hisparse_settings(HiSparseArgs(hisparse, hisparse_block, hisparse_topk, hisparse_hot, hisparse_min_context,
                                        hisparse_store))
    engine = build(source, engine_config(device, dtype, max_batch, max_batched_tokens, chunk_size,
                                           kv_cache_tokens, None, cuda_graphs, host_threads, hs))
    note_cache_size(kv_cache_tokens, max_batch)
    try:
        report = run_load(engine, spec)
    except EngineError as exc:
        fail(str(exc), 1)
    finally:
        if engine.kv_offload is not None:
            engine.kv_offload.close()
    result = {"preset": source, "device": str(engine.device), **spec.__dict__, **report.as_dict()}
    if engine.kv_offload is not None:
        result["hisparse"] = hisparse_report(engine)
    if as_json:
        typer.echo(json.dumps(result))
        return
    typer.echo(
        f"{source}: {report.num_requests} requests x {prompt_len} prompt tokens -> {max_new_tokens} new tokens "
        f"in {report.duration_s:.2f} s on {engine.device}\n"
        f"  TTFT ms   p50 {report.ttft_ms_p50:.1f}  p99 {report.ttft_ms_p99:.1f}  mean {report.ttft_ms_mean:.1f}\n"
        f"  TPOT ms   p50 {report.tpot_ms_p50:.2f}   e2e ms p50 {report.e2e_ms_p50:.1f}  p99 {report.e2e_ms_p99:.1f}\n"
        f"  throughput {report.requests_per_s:.2f} req/s, {report.output_tokens_per_s:.1f} output tok/s, "
        f"{report.total_tokens_per_s:.1f} total tok/s, {report.num_preemptions} preemptions"
    )


def expand_bare_store(argv: list[str]) -> list[str]:
    """`--store` given without a value (last, or followed by another option) becomes
    `--store=` (the default socket); everything else is left as it is."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--store" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append("--store=")
        else:
            out.append(arg)
    return out


def main() -> None:
    app(args=expand_bare_store(sys.argv[1:]), prog_name="kvengine")


if __name__ == "__main__":
    sys.exit(main())

"""``picompile bench``'s report: the result of :func:`picompile.tools.bench.run_bench` as a rich table
of the engines and the notes under it (bytes per token, the bandwidth bound, token agreement, load)."""
from __future__ import annotations

from typing import Any


def _gb(x: float) -> str:
    return f"{x / 1e9:.3f} GB" if x >= 1e8 else f"{x / 1e6:.3f} MB"


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def print_report(result: dict[str, Any], console: Any | None = None) -> None:
    """The result as a table of engines and a few lines of notes (bytes, bound, agreement, load)."""
    from rich.console import Console
    from rich.markup import escape

    console = console or Console(highlight=False)
    console.print(_engine_table(result))
    for name, why in result["skipped"].items():
        console.print(escape(f"{name}: skipped ({why})"))
    for line in _notes(result):
        console.print(line)


def _engine_table(result: dict[str, Any]) -> Any:
    from rich.markup import escape
    from rich.table import Table

    title = escape(f"{result['artifact']}  (threads {result['threads']}, prompt {result['prompt_len']}, "
             f"decode {result['tokens']} tokens, {result['repeats']} interleaved rounds, medians)")
    table = Table(title=title, title_justify="left")
    for col in ("engine", "prefill tok/s", "decode tok/s", "prefill vs PyTorch", "decode vs PyTorch", "best decode tok/s"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    for eng in result["engines"].values():
        table.add_row(escape(eng["label"]), f"{eng['prefill_tokens_per_s']:.2f}", f"{eng['decode_tokens_per_s']:.2f}",
                      _x(eng["prefill_vs_pytorch"]), _x(eng["decode_vs_pytorch"]),
                      f"{eng['best_decode_tokens_per_s']:.2f}")
    return table


def _notes(result: dict[str, Any]) -> list[str]:
    """The report's lines under the table (rich markup), in order."""
    from rich.markup import escape

    lines = _llama_cpp_notes(result)
    lines += [_bytes_note(result), _bound_note(result)]
    if result.get("prefill_dtype"):
        agree = result["low_prefill_logits"]
        lines.append(f"prefill_dtype={result['prefill_dtype']}: prefill {_x(result['low_prefill_speedup'])} PyTorch "
                     f"(default {_x(result['prefill_speedup'])}); its prompt logits against the default's: relative "
                     f"error {agree['relative_error']:.1e}, top token equal at {agree['top1_agreement']:.0%} of positions")
    lines += _prefill_gemm_notes(result)
    if result.get("compiled"):
        native = (f"{result['native_kernel_calls']} kernel calls per decode step as C++ ops" if result["native_kernel_calls"]
                  else f"kernel calls through Python ({result['native_reason']})")
        lines.append(f"compiled step: {native}; greedy tokens equal to the eager step's: first "
                     f"{result['same_tokens_as_eager']} of {result['tokens'] + 1}")
    same = result["same_tokens_as_pytorch"]
    agreement = "no PyTorch run" if same is None else f"first {same} of {result['tokens'] + 1}"
    lines.append(f"[dim]greedy tokens equal to PyTorch's: {agreement}; load average {result['load_average'][0]:.2f} → {result['load_average'][1]:.2f}"
                 f"{'; SYNTHETIC model' if result['synthetic'] else ''}[/dim]")
    if result["kernels"] and (result["omp_wait_policy"] or "").upper() != "PASSIVE":
        lines.append(f"[dim]note: OMP_WAIT_POLICY={result['omp_wait_policy']}: torch's OpenMP workers spin after "
                     "each op and take the cores the TVM kernels need (picompile defaults it to PASSIVE)[/dim]")
    return lines


def _bytes_note(result: dict[str, Any]) -> str:
    act = result["ffn_active_fraction"] if result["ffn_active_fraction"] is not None else result["ffn_active_fraction_manifest"]
    fired = result.get("ffn_fired_fraction")
    return (
        f"bytes/token: {_gb(result['bytes_per_token'])} (FFN {_gb(result['ffn_bytes_per_token'])} of "
        f"{_gb(result['ffn_bytes_dense'])} dense, masks select {'%.1f%%' % (100 * act) if act is not None else 'all'} "
        f"of the neurons ({result['active_source']})"
        + (f", {100 * fired:.1f}% selected and firing (the rest cost only their gate rows)"
           if fired is not None and act is not None and fired < act else "")
        + f"; other weights {_gb(result['other_bytes_per_token'])}, "
        f"KV {_gb(result['kv_bytes_per_token'])}); dense {_gb(result['dense_bytes_per_token'])}")


def _bound_note(result: dict[str, Any]) -> str:
    copy = f" (copy {result['copy_bandwidth_gbs']:.2f} GB/s, read + write)" if "copy_bandwidth_gbs" in result else ""
    line = (f"read bandwidth {result['bandwidth_gbs']:.2f} GB/s around picompile's runs{copy} → bound {result['bound_tokens_per_s']:.2f} tok/s "
            f"(dense bound {result['dense_bound_tokens_per_s']:.2f}); picompile decode reaches "
            f"{result['decode_tokens_per_s'] / result['bound_tokens_per_s']:.0%} of its bound")
    if "llama_cpp_bound_tokens_per_s" in result:
        line += (f"; llama.cpp reads {_gb(result['llama_cpp_bytes_per_token'])}/token (its GGUF, dense), "
                 f"read bandwidth {result['llama_cpp_bandwidth_gbs']:.2f} GB/s "
                 f"around its runs → bound "
                 f"{result['llama_cpp_bound_tokens_per_s']:.2f} tok/s, its tg reaches "
                 f"{result['llama_cpp_bound_share']:.0%}")
    return line


def _llama_cpp_notes(result: dict[str, Any]) -> list[str]:
    """llama.cpp's side: what llama-bench ran on, the ratios picompile / llama.cpp, llama-cpp-python's tokens."""
    from rich.markup import escape

    lines = []
    lb = result["engines"].get("llama-bench")
    if lb and "decode_vs_llama_cpp" in result:
        facts = lb.get("llama_bench_json") or {}
        fa = {-1: "auto", 0: "off", 1: "on"}.get(facts.get("flash_attn"), str(facts.get("flash_attn", "?")))
        build = f"build {str(facts.get('build_commit', '?'))[:10]}, flash attention {fa}"
        precision = ("same precision as the artifact" if lb.get("same_precision")
                     else f"the artifact's weights are {lb.get('artifact_weight_dtype')}")
        act = lb.get("source_activation", "silu")
        lines.append(f"picompile / llama.cpp: decode [bold]{result['decode_vs_llama_cpp']:.2f}x[/bold], prefill "
                     f"[bold]{result['prefill_vs_llama_cpp']:.2f}x[/bold] (llama-bench tg{result['tokens']} from an "
                     f"empty context, pp{result['prompt_len']})")
        lines.append(escape(f"llama.cpp: {lb['command']} ({build}); weights {lb['gguf_type']}, {precision}")
                     + ("" if act == "silu" else escape(f"; its llama architecture computes SiLU in the FFN, this "
                        f"checkpoint {act}: a dense-speed baseline of the same shape and bytes, not the same outputs")))
    if lb and lb.get("pp_fallback"):
        lines.append(escape(f"llama.cpp's prefill: {lb['pp_fallback']}"))
    text = result.get("llama_cpp_python")
    if text:
        lines.append(escape(f"llama-cpp-python ({text['gguf']}, not timed): greedy tokens equal to picompile's: first "
                            f"{text['same_tokens_as_picompile']} of {result['tokens'] + 1}, to PyTorch's: first "
                            f"{text['same_tokens_as_pytorch']}"))
    return lines


PREFILL_GEMM_WARN = 0.5  # prefill's GEMM rate under this share of the probe's best: a warning line
PREFILL_GEMM_MIN_FLOP = 1e10  # … for a prefill of at least this many GEMM FLOPs (a tiny model's is all dispatch)


def _prefill_gemm_notes(result: dict[str, Any]) -> list[str]:
    """Prefill's GEMM rate against a bare GEMM of the FFN's shape measured in the same run
    (``tools/gemm_probe.py``), as a warning when it is far below (a layout or per-call conversion losing it)."""
    probe, rate = result.get("gemm_probe_gflops"), result.get("prefill_gemm_gflops")
    if not probe or rate is None:
        return []
    dtype, best = max(probe.items(), key=lambda kv: kv[1])
    each = ", ".join(f"{k} {v:.0f}" for k, v in probe.items())
    text = (f"prefill GEMMs ran at {rate:.0f} GFLOP/s (all of prefill's time counted), {rate / best:.0%} of a bare "
            f"{dtype} GEMM of the FFN's shape at prompt {result['prompt_len']} here ({each} GFLOP/s)")
    if result.get("sparse_prefill_parts"):  # fewer FLOPs done than counted: the rate is a dense-equivalent one
        text += (f"; counted as dense GEMMs' FLOPs, though {result['sparse_prefill_parts']} ReLU FFN parts compute "
                 "their up and down rows only where the gate fired")
    big = result.get("gemm_flop_per_token", 0) * result["prompt_len"] >= PREFILL_GEMM_MIN_FLOP  # else dispatch-bound
    if big and rate < PREFILL_GEMM_WARN * best:
        return [f"[yellow]warning: {text}: a prefill GEMM path runs far below this machine's rate[/yellow]"]
    return [f"[dim]{text}[/dim]"]

"""Turns the benchmark results into markdown tables, target verdicts and PNG plots."""

from __future__ import annotations

from pathlib import Path


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4f}"


def render_markdown(results: dict) -> str:
    """All tables, then the targets with met / not met."""
    out = ["## Decode (1 thread, ms per token, median)", "",
           "| model | configuration | step | tokens/s | x base | graph's own x (bare invokes) | runtime's share of the step | slot |",
           "|---|---|---:|---:|---:|---:|---:|---|"]
    for model, configs in results["decode"].items():
        graph = configs["_graph"]
        base = configs["base"]["step"]
        for name, d in configs.items():
            if name.startswith("_"):
                continue
            slot = d["slot"]
            own = graph[f"r{slot}"] / graph["plain"] if slot else 1.0
            out.append(f"| {model} | {name} | {_ms(d['step'])} | {1 / d['step']:,.0f} | {d['step'] / base:.3f} | "
                       f"{own:.3f} | {100 * d['glue_share']:.1f}% | {('r' + str(slot)) if slot else 'plain'} |")
    out += ["", "## Registering an adapter file (256 tensors, median)", "", "| file | LoraData.create_from_file_path |",
            "|---:|---:|"]
    out += [f"| {mb:.0f} MB | {ms:.2f} ms |" for mb, ms in results["register"]]
    sw = results["switch"]
    out += ["", "## Switching (bench model f32, rank-8 adapters, per decode step)", "", "| what | ms | x one session |",
            "|---|---:|---:|",
            f"| one session, one adapter | {_ms(sw['alone'])} | 1.000 |",
            f"| two sessions alternating, same adapter | {_ms(sw['alternate_same'])} | {sw['alternate_same'] / sw['alone']:.3f} |",
            f"| two sessions alternating, different adapters | {_ms(sw['alternate_other'])} | {sw['alternate_other'] / sw['alone']:.3f} |",
            f"| one session switched between two resident adapters, + next step | {_ms(sw['switch'])} | {sw['switch'] / sw['alone']:.3f} |"]
    out += ["", "| cold switch (adapter evicted, rebuilt) + one decode step | buffers | ms |", "|---|---:|---:|"]
    out += [f"| | {nbytes / 1024:.0f} KiB | {seconds * 1e3:.3f} |" for nbytes, seconds in results["cold_switch"]]
    mem = results["memory"]
    out += ["", "## Memory (VmRSS, bench model, rank-8 adapters)", "", "| what | value |", "|---|---:|",
            f"| RSS per registered (not resident) adapter | {mem['registered_per_adapter_bytes'] / 1024:.1f} KiB |",
            f"| adapter tensor bytes (float32) | {mem['tensor_bytes_per_adapter'] / 1024:.1f} KiB |",
            f"| RSS of the first resident adapter (heap growth, first binding included) | {mem['resident_first_adapter_bytes'] / 1024:.1f} KiB |",
            f"| RSS per further resident adapter (slope, 16 resident at once) | {mem['resident_per_adapter_bytes'] / 1024:.1f} KiB |",
            f"| its slot buffers (float32) | {mem['slot_float32_bytes'] / 1024:.1f} KiB |",
            f"| RSS growth with all registered, each used once under Lru(4) | {mem['rss_all_registered_used_once_lru4_bytes'] / 1024:.0f} KiB |",
            f"| resident after that walk | {mem['resident_after_walk']} |",
            f"| RSS growth per switch+decode cycle | {mem['growth_per_switch_bytes']:.2f} B |",
            f"| RSS left after unloading all | {mem['after_unload_bytes'] / 1024:.0f} KiB |"]
    conc = results["concurrency"]
    one = conc[1] if 1 in conc else conc["1"]
    out += ["", "## Concurrent sessions (distinct adapters, one thread each)", "", "| sessions | tokens/s | x one |",
            "|---:|---:|---:|"]
    out += [f"| {n} | {tps:,.0f} | {tps / one:.3f} |" for n, tps in conc.items()]
    llama = results.get("llama_cpp")
    if llama:
        out += ["", *llama_table(results, llama)]
    if results.get("head_to_head"):
        out += ["", *head_to_head_table(results["head_to_head"])]
    out += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|", *targets(results)]
    return "\n".join(out)


HEAD_TO_HEAD_TARGETS = (("f32", "f32", 1.0), ("q8_0", "int8 vs q8_0", 1.3))
HEAD_TO_HEAD_NAMES = {"plain": "base", "lora_r8": "rank-8 adapter"}


def head_to_head_table(h2h: dict) -> list[str]:
    """Ours vs llama.cpp measured in alternating rounds (the ratios the targets use)."""
    rows = ["## Head to head with llama.cpp, alternating rounds (same weights, 1 thread)", "",
            "Each round times both sides back to back; speed = their ms / ours, median over rounds "
            "(range in brackets).", "",
            "| precision | configuration | ours ms/token | llama.cpp ms/token | ours / theirs speed |",
            "|---|---|---:|---:|---:|"]
    for kind, precision, _ in HEAD_TO_HEAD_TARGETS:
        for name, e in h2h.get(kind, {}).items():
            rows.append(f"| {precision} | {HEAD_TO_HEAD_NAMES[name]} | {e['ours_ms']:.4f} | {e['theirs_ms']:.4f} | "
                        f"{e['speed']:.2f}x [{e['speed_min']:.2f}-{e['speed_max']:.2f}], {e['rounds']} rounds |")
    return rows


LLAMA_PAIRS = [("base", "plain"), ("rank-8 adapter", "lora_r8"), ("blend of two rank-8 (0.7/0.3)", "blend_r8_a0.7_b0.3"),
               ("rank-64 adapter", "lora_r64")]


def llama_table(results: dict, llama: dict) -> list[str]:
    """Ours vs llama.cpp on the same weights."""
    ours = {"f32": results["decode"]["bench model f32"], "q8_0 / int8": results["decode"]["bench model int8"]}
    theirs = {"f32": llama["models"].get("f32", {}), "q8_0 / int8": llama["models"].get("q8_0", {})}
    rows = ["## Side by side with llama.cpp (same weights, 1 thread)", "",
            "| precision | configuration | ours ms/token | llama.cpp ms/token | ours / theirs speed |", "|---|---|---:|---:|---:|"]
    for precision in ours:
        decode = theirs[precision].get("decode_ms_per_token_exact_ctx", {})
        for our_name, their_name in LLAMA_PAIRS:
            if our_name in ours[precision] and their_name in decode:
                mine, other = ours[precision][our_name]["step"] * 1e3, decode[their_name]["median"]
                rows.append(f"| {precision} | {our_name} | {mine:.4f} | {other:.4f} | {other / mine:.2f}x |")
    switch = theirs["f32"].get("switch_exact_ctx", {})
    if switch:
        rows += ["", f"llama.cpp switch between two loaded adapters + next decode: "
                 f"{switch.get('switch_a_b_plus_decode_ms', float('nan')):.4f} ms "
                 f"({switch.get('switch_a_b_plus_decode_over_plain_decode', float('nan')):.3f}x its plain step); "
                 f"ours: {results['switch']['switch'] * 1e3:.4f} ms "
                 f"({results['switch']['switch'] / results['switch']['alone']:.3f}x our step)."]
    memory = theirs["f32"].get("adapter_rss_fresh_process", {}).get("r8_a", {})
    register = theirs["f32"].get("adapter_register_ms", {})
    if register:
        rows.append(f"llama.cpp adapter register (init) time: rank 8 {register.get('r8_a')} ms, rank 64 "
                    f"{register.get('r64')} ms (it reads and copies the file).")
    if memory:
        rows.append(f"llama.cpp RSS per loaded rank-8 adapter: {memory.get('rss_growth_per_adapter_kib')} KiB; "
                    f"ours per registered adapter: {results['memory']['registered_per_adapter_bytes'] / 1024:.1f} KiB, "
                    f"per resident: {results['memory']['resident_per_adapter_bytes'] / 1024:.1f} KiB.")
    return rows


def targets(results: dict) -> list[str]:
    """The issue's targets, each with the measured figure and a verdict."""
    rows = []

    def add(target: str, measured: str, met: bool) -> None:
        rows.append(f"| {target} | {measured} | {'yes' if met else 'NO'} |")

    for model, configs in results["decode"].items():
        graph = configs["_graph"]
        worst_glue = max(d["glue_share"] for k, d in configs.items() if not k.startswith("_"))
        add(f"runtime's own work <= 3% of a decode step ({model})", f"worst {100 * worst_glue:.1f}%",
            worst_glue <= 0.03)
        base = configs["base"]["step"]
        for name, d in configs.items():
            if name.startswith("_") or not d["slot"]:
                continue
            own = graph[f"r{d['slot']}"] / graph["plain"]
            ratio = d["step"] / base
            add(f"adapter / plain <= graph's own ratio + 3% ({model}, {name})", f"{ratio:.3f} vs {own:.3f} + 0.03",
                ratio <= own + 0.03)
    sw = results["switch"]
    add("switch between resident adapters + next step <= 1.05x a plain step (two sessions)",
        f"{sw['alternate_other'] / sw['alone']:.3f}x", sw["alternate_other"] / sw["alone"] <= 1.05)
    add("same, one session re-targeted with set_adapters", f"{sw['switch'] / sw['alone']:.3f}x",
        sw["switch"] / sw["alone"] <= 1.05)
    register = results["register"]
    spread = max(ms for _, ms in register) / min(ms for _, ms in register)
    add("register time independent of file size", f"{register[0][1]:.2f} ms at {register[0][0]:.0f} MB, "
        f"{register[-1][1]:.2f} ms at {register[-1][0]:.0f} MB", spread < 2.0)
    mem = results["memory"]
    add("registered, non-resident adapter <= 64 KB RSS", f"{mem['registered_per_adapter_bytes'] / 1024:.1f} KiB",
        mem["registered_per_adapter_bytes"] <= 64 * 1024)
    ratio = mem["resident_per_adapter_bytes"] / mem["slot_float32_bytes"]
    add("resident adapter <= 1.1x its float32 tensor bytes (each beyond the first)", f"{ratio:.3f}x", ratio <= 1.1)
    add("0 bytes growth per switch", f"{mem['growth_per_switch_bytes']:.2f} B", mem["growth_per_switch_bytes"] <= 1.0)
    conc = results["concurrency"]
    one = conc.get(1, conc.get("1"))
    eight = conc.get(8, conc.get("8"))
    add("8 concurrent sessions >= 0.95x the tokens/s of one", f"{eight / one:.3f}x", eight / one >= 0.95)
    llama = results.get("llama_cpp")
    h2h = results.get("head_to_head")
    if h2h:
        for kind, precision, factor in HEAD_TO_HEAD_TARGETS:
            for name, e in h2h.get(kind, {}).items():
                add(f"decode tokens/s >= {factor}x llama.cpp ({precision}, {HEAD_TO_HEAD_NAMES[name]}; alternating rounds)",
                    f"{e['speed']:.2f}x", e["speed"] >= factor)
    elif llama:
        for precision, ours_key, their_key, factor in (("f32", "bench model f32", "f32", 1.0),
                                                       ("int8 vs q8_0", "bench model int8", "q8_0", 1.3)):
            decode = llama["models"].get(their_key, {}).get("decode_ms_per_token_exact_ctx", {})
            for our_name, their_name in LLAMA_PAIRS[:2]:
                if their_name in decode:
                    speed = decode[their_name]["median"] / (results["decode"][ours_key][our_name]["step"] * 1e3)
                    add(f"decode tokens/s >= {factor}x llama.cpp ({precision}, {our_name})", f"{speed:.2f}x",
                        speed >= factor)
    return rows


def plots(results: dict, folder: Path) -> None:
    """decode.png, register.png and concurrency.png (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plots")
        return
    figure, axis = plt.subplots(figsize=(9, 4))
    labels, values = [], []
    for model, configs in results["decode"].items():
        for name, d in configs.items():
            if not name.startswith("_"):
                labels.append(f"{model}\n{name}")
                values.append(1 / d["step"])
    axis.barh(labels, values)
    axis.set_xlabel("decode tokens/s (1 thread)")
    axis.tick_params(axis="y", labelsize=6)
    figure.tight_layout()
    figure.savefig(folder / "decode.png", dpi=120)
    plt.close(figure)
    figure, axis = plt.subplots(figsize=(5, 3.5))
    sizes, times = zip(*results["register"])
    axis.plot(sizes, times, marker="o")
    axis.set_xscale("log")
    axis.set_ylim(bottom=0)
    axis.set_xlabel("adapter file size (MB)")
    axis.set_ylabel("register time (ms)")
    figure.tight_layout()
    figure.savefig(folder / "register.png", dpi=120)
    plt.close(figure)
    figure, axis = plt.subplots(figsize=(5, 3.5))
    counts = [int(n) for n in results["concurrency"]]
    axis.plot(counts, list(results["concurrency"].values()), marker="o")
    axis.set_xlabel("concurrent sessions")
    axis.set_ylabel("aggregate tokens/s")
    axis.set_ylim(bottom=0)
    figure.tight_layout()
    figure.savefig(folder / "concurrency.png", dpi=120)
    plt.close(figure)

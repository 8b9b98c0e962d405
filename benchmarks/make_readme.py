"""benchmarks/README.md's tables, and its plots, made from the results under benchmarks/results/.

    python benchmarks/make_readme.py                  # rewrite the tables between the markers
    python benchmarks/make_readme.py --check          # exit 1 where README.md differs from what it would write
    python benchmarks/make_readme.py --plots          # the SVG plots too (matplotlib: pip install -e ".[bench]")
    python benchmarks/make_readme.py --check --plots  # and check the plots as well

Each benchmarks/results/NAME.json is one table: a title, the question it answers, the runs it
was made from (machine, date, raylm commit, command), its rows and notes, and where its figures
come from (`source`: a benchmark's own JSON output, or transcribed from an earlier record). A run
is {machine, date, raylm_commit, command, note, history}.
Three kinds:

- "peer": raylm against another engine. `workloads` names the columns by the keys the
  comparison scripts write (compare_llamacpp.py: decode_tok_s, prefill128_tok_s, one_s,
  batch_tok_s, online_tok_s, online_ttft_ms; compare_vllm.py: throughput_tok_s, latency_s);
  a row's cell is {raylm, peer, raylm_spread, peer_spread, speed, run}. `speed` is how many
  times faster raylm is (rates: raylm / peer; times: peer / raylm), computed where absent; a
  cell's `run` is given where it comes from another run than its row's.
- "migration_by_length": bench_migration.py's per-length fields (downtime, extra_pause,
  handover, inter_token, migration, recompute as {median_ms, p99_ms}; mib_moved; the
  pre-copy slowdowns in %).
- "table": `columns` as [key, label] pairs, cells as written.

The plots import matplotlib only when asked for, so the table check runs without it.
"""

from __future__ import annotations

import argparse
import difflib
import json
import pathlib
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
PLOTS = HERE / "plots"
README = HERE / "README.md"
BEGIN = (
    "<!-- tables:begin (made by benchmarks/make_readme.py from benchmarks/results/*.json; edit those, then run it) -->"
)
END = "<!-- tables:end -->"

# The README's order; a results file not named here follows these, by name.
ORDER = [
    "vllm",
    "llamacpp",
    "quantized",
    "perplexity",
    "online",
    "migration",
    "migration_by_length",
    "kv_transport",
    "context_parallel",
    "kv_flood",
    "two_hosts",
    "scale_in",
    "gpu",
]

# key: (column title, unit, higher is better)
WORKLOADS = {
    "decode_tok_s": ("batch-1 decode", "tok/s", True),
    "prefill128_tok_s": ("prefill 128", "tok/s", True),
    "prefill512_tok_s": ("prefill 512", "tok/s", True),
    "one_s": ("one request 128/128", "s", False),
    "batch_tok_s": ("64 x 128/128", "output tok/s", True),
    "online_tok_s": ("64 streams", "output tok/s", True),
    "online_ttft_ms": ("median TTFT", "ms", False),
    "throughput_tok_s": ("64 x 128/128", "output tok/s", True),
    "latency_s": ("one request 128/128", "s", False),
}


def load_results() -> list[tuple[str, dict]]:
    names = sorted(p.stem for p in RESULTS.glob("*.json"))
    ordered = [n for n in ORDER if n in names] + [n for n in names if n not in ORDER]
    return [(n, json.loads((RESULTS / f"{n}.json").read_text())) for n in ordered]


def num(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer() and abs(value) >= 100:
        return str(int(value))
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def signed(value) -> str:
    return "" if value is None else f"{value:+g}%"


def speed_of(cell: dict, key: str) -> float | None:
    if "speed" in cell:
        return cell["speed"]
    ours, theirs = cell.get("raylm"), cell.get("peer")
    if not ours or not theirs:
        return None
    return ours / theirs if WORKLOADS[key][2] else theirs / ours


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    return ["| " + " | ".join(map(esc, header)) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(map(esc, r)) + " |" for r in rows
    ]


def peer_table(doc: dict) -> list[str]:
    many = len(doc["runs"]) > 1
    peer = doc["peer"]
    header = (["run"] if many else []) + ["model", "variant"]
    for key in doc["workloads"]:
        title, unit, _ = WORKLOADS[key]
        header.append(f"{title}, {unit}: raylm / {peer} (speed)")
    rows = []
    for row in doc["rows"]:
        runs = [row["run"]] + sorted(
            {
                c["run"]
                for k in doc["workloads"]
                if isinstance(c := row.get(k), dict) and c.get("run", row["run"]) != row["run"]
            }
        )
        cells = ([", ".join(runs)] if many else []) + [row["model"], row["variant"]]
        for key in doc["workloads"]:
            cell = row.get(key)
            if not cell:
                cells.append("")
                continue
            speed = speed_of(cell, key)
            # A stated speed keeps its two decimals; one computed here from rounded figures gets 3 digits.
            shown = f"{speed:.2f}" if "speed" in cell else f"{speed:.3g}" if speed else ""
            text = f"{num(cell['raylm'])} / {num(cell['peer'])}" + (f" ({shown}x)" if shown else "")
            if cell.get("run", row["run"]) != row["run"]:
                text += f" <sup>{cell['run']}</sup>"
            cells.append(text)
        rows.append(cells)
    return md_table(header, rows)


def migration_table(doc: dict) -> list[str]:
    header = [
        "run",
        "model",
        "where",
        "prompt",
        "downtime (max)",
        "over a normal gap",
        "handover",
        "normal gap",
        "whole migration",
        "MiB",
        "pre-copy slowdown src / dst",
        "recompute instead",
    ]
    ms = lambda d, k="median_ms": f"{num(d[k])} ms" if d else ""  # noqa: E731
    rows = [
        [
            r["run"],
            r["model"],
            r["where"],
            str(r["prompt_tokens"]),
            f"{num(r['downtime']['median_ms'])} ms ({num(r['downtime']['p99_ms'])})",
            ms(r["extra_pause"]),
            ms(r["handover"]),
            ms(r["inter_token"]),
            ms(r["migration"]),
            num(r["mib_moved"]),
            f"{signed(r['source_precopy_slowdown_pct'])} / {signed(r['destination_precopy_slowdown_pct'])}",
            ms(r["recompute"]),
        ]
        for r in doc["rows"]
    ]
    return md_table(header, rows)


def plain_table(doc: dict) -> list[str]:
    keys = [k for k, _ in doc["columns"]]
    return md_table([label for _, label in doc["columns"]], [[num(r.get(k, "")) for k in keys] for r in doc["rows"]])


def section(name: str, doc: dict) -> list[str]:
    kind = doc.get("kind", "table")
    body = {"peer": peer_table, "migration_by_length": migration_table, "table": plain_table}[kind](doc)
    out = [f"### {doc['title']}", "", f"*{doc['question']}*", "", *body, ""]
    runs = doc["runs"]
    for letter, run in runs.items():
        lead = f"- **{letter}**: " if len(runs) > 1 else "- "
        note = run.get("raylm_commit_note")
        commit = f"raylm {run['raylm_commit']}" + (f" ({note})" if note else "")
        history = f"; the whole run: [{run['history']}]({run['history']})" if run.get("history") else ""
        note = f" ({run['note']})" if run.get("note") else ""
        out.append(f"{lead}{run['machine']}; {run['date']}; {commit}: `{run['command']}`{note}{history}")
    out += ["", f"Raw results: [results/{name}.json](results/{name}.json), {doc['source']}."]
    out += [line for note in doc.get("notes", []) for line in ("", note)]
    return out + [""]


def tables_block() -> str:
    lines = [BEGIN, ""]
    for name, doc in load_results():
        lines += section(name, doc)
    return "\n".join(lines + [END])


def render_readme(current: str) -> str:
    start, stop = current.find(BEGIN), current.find(END)
    if start < 0 or stop < start:
        raise SystemExit(f"{README}: the markers {BEGIN!r} ... {END!r} are missing")
    return current[:start] + tables_block() + current[stop + len(END) :]


# ---------------------------------------------------------------- plots (matplotlib, optional)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit('--plots needs matplotlib: pip install -e ".[bench]"') from None
    matplotlib.use("svg")
    matplotlib.rcParams.update(
        {"svg.hashsalt": "raylm-benchmarks", "svg.fonttype": "none", "font.family": "DejaVu Sans", "font.size": 9}
    )
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: pathlib.Path) -> None:
    fig.savefig(path, format="svg", metadata={"Date": None, "Creator": None}, bbox_inches="tight")


def plot_decode_by_batch(plt, out: pathlib.Path) -> None:
    """raylm's speed against each peer at batch 1 and batch 64, bf16, one panel per machine."""
    docs = dict(load_results())
    points = []  # (machine, batch, label, speed, raylm, peer)
    for name, peer in (("llamacpp", "llama.cpp"), ("vllm", "vLLM")):
        doc = docs[name]
        for row in doc["rows"]:
            if name == "vllm" and not row["variant"].endswith("uni"):
                continue
            for key, batch in (("decode_tok_s", 1), ("batch_tok_s", 64), ("throughput_tok_s", 64)):
                cell = row.get(key)
                if cell:
                    machine = doc["runs"][cell.get("run", row["run"])]["machine"]
                    machine = "AMD EPYC Zen 3 (AVX2), 2 vCPUs" if "Zen 3" in machine else "AVX-512 BF16 VM, 2 vCPUs"
                    points.append(
                        (machine, batch, f"{row['model']} vs {peer}", speed_of(cell, key), cell["raylm"], cell["peer"])
                    )
    machines = sorted({p[0] for p in points})
    labels = sorted({p[2] for p in points}, key=lambda s: (s.split(" vs ")[1], s))
    colors = dict(zip(labels, ["#1f77b4", "#aec7e8", "#d62728", "#ff9896"]))
    fig, axes = plt.subplots(1, len(machines), figsize=(4.6 * len(machines), 3.6), sharey=True)
    for ax, machine in zip(axes, machines):
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            for batch_index, batch in enumerate((1, 64)):
                for m, b, lab, speed, ours, theirs in points:
                    if (m, b, lab) != (machine, batch, label):
                        continue
                    x = batch_index + (i - (len(labels) - 1) / 2) * width
                    legend = label if batch_index == 1 or batch == 1 else None
                    ax.bar(x, speed, width, color=colors[label], label=legend)
                    ax.annotate(f"{ours:g}\n/ {theirs:g}", (x, speed), ha="center", va="bottom", fontsize=6)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([0, 1], ["batch 1\n(batch-1 decode)", "batch 64\n(64 x 128/128)"])
        ax.set_yscale("log")
        ax.set_yticks([0.5, 1, 2, 5, 10], ["0.5x", "1x", "2x", "5x", "10x"])
        ax.minorticks_off()
        ax.set_title(machine, fontsize=9)
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0].set_ylabel("raylm's speed / the peer's (log scale), bf16")
    handles, names = [], []
    for ax in axes:
        for h, n in zip(*ax.get_legend_handles_labels()):
            if n not in names:
                handles.append(h), names.append(n)
    order = sorted(range(len(names)), key=lambda j: labels.index(names[j]))
    fig.legend(
        [handles[j] for j in order],
        [names[j] for j in order],
        loc="lower center",
        ncol=4,
        bbox_to_anchor=(0.5, -0.08),
        frameon=False,
    )
    fig.suptitle(
        "Decode tok/s by batch size against the peers: raylm's speed (bars), raylm / peer tok/s (labels)", fontsize=10
    )
    _save(fig, out)
    plt.close(fig)


def plot_migration_pause(plt, out: pathlib.Path) -> None:
    doc = dict(load_results())["migration_by_length"]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    series: dict[str, list[dict]] = {}
    for row in doc["rows"]:
        series.setdefault(f"{row['model']}, {row['where']}", []).append(row)
    for (label, rows), color in zip(series.items(), ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]):
        xs = [r["prompt_tokens"] for r in rows]
        ax.plot(
            xs, [r["downtime"]["median_ms"] for r in rows], marker="o", color=color, label=f"migration pause, {label}"
        )
        if all(r["recompute"] for r in rows):
            ax.plot(
                xs,
                [r["recompute"]["median_ms"] for r in rows],
                marker="s",
                linestyle="--",
                color=color,
                label=f"recompute instead, {label}",
            )
    ax.set_xlabel("prompt tokens of the request moved")
    ax.set_ylabel("client's gap between two tokens, ms (median)")
    ax.set_xticks([256, 1024, 2048])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, frameon=False)
    machines = {run["machine"] for run in doc["runs"].values()}
    where = "AMD EPYC Zen 3, 2 vCPUs" if all("Zen 3" in m for m in machines) else "; ".join(sorted(machines))
    ax.set_title(f"Live migration: the pause by prompt length ({where})", fontsize=9)
    _save(fig, out)
    plt.close(fig)


PLOT_FILES = {"decode_by_batch.svg": plot_decode_by_batch, "migration_pause.svg": plot_migration_pause}


def write_plots(folder: pathlib.Path) -> None:
    plt = _pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    for name, make in PLOT_FILES.items():
        make(plt, folder / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 where a file would change")
    parser.add_argument("--plots", action="store_true", help="the SVG plots too (needs matplotlib)")
    args = parser.parse_args(argv)
    current = README.read_text()
    wanted = render_readme(current)
    stale = []
    if wanted != current:
        stale.append(str(README.relative_to(HERE.parent)))
        if args.check:
            sys.stdout.writelines(
                difflib.unified_diff(
                    current.splitlines(True), wanted.splitlines(True), "README.md", "README.md (made)", n=1
                )
            )
        else:
            README.write_text(wanted)
    if args.plots:
        with tempfile.TemporaryDirectory() as tmp:
            write_plots(pathlib.Path(tmp))
            for name in PLOT_FILES:
                made = pathlib.Path(tmp, name).read_bytes()
                path = PLOTS / name
                if not path.exists() or path.read_bytes() != made:
                    stale.append(str(path.relative_to(HERE.parent)))
                    if not args.check:
                        PLOTS.mkdir(exist_ok=True)
                        path.write_bytes(made)
    if args.check and stale:
        print(
            f"\nout of date: {', '.join(stale)}; run python benchmarks/make_readme.py"
            + (" --plots" if args.plots else ""),
            file=sys.stderr,
        )
        return 1
    if stale:
        print(f"wrote {', '.join(stale)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

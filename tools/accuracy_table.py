"""Writes the accuracy table of docs/accuracy.md: `trainmem compare` over data/ground_truth (and parallel/).

    python tools/accuracy_table.py [--bin build/trainmem] > table.md
"""
import argparse
import json
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=str(ROOT / "build" / "trainmem"))
    args = ap.parse_args()
    rows, errors = [], []
    corpus = ROOT / "data" / "ground_truth"
    for path in sorted([*corpus.glob("*.json"), *(corpus / "parallel").glob("*.json")], key=lambda p: p.stem):
        if path.name in ("index.json", "matrix.json"):
            continue
        c = json.loads(subprocess.run([args.bin, "compare", str(path), "--json"], capture_output=True, text=True,
                                      check=True, cwd=ROOT).stdout)
        worst_cat = max(c["categories"].items(), key=lambda kv: abs(kv[1]["diff_pct_of_peak"]))
        r = c["recipe"]
        if r.get("mode") == "inference":
            knobs = f"generate {r['precision']} {r['attention']} new_tokens={r['new_tokens']} beams={r['beams']}"
        else:
            knobs = f"{r['precision']} {r['optimizer']} {r['attention']} ck={r['checkpointing']} ga={r['grad_accum']} {r['loss']}"
        if r.get("parallel", "none") != "none":
            knobs = f"{r['parallel']}×{r['gpus']} " + knobs
        if r.get("tp", 1) > 1:
            knobs = f"tp×{r['tp']}{'+sp' if r.get('sequence_parallel') else ''}{'+lp' if r.get('loss_parallel') else ''} " + knobs
        if r.get("pp", 1) > 1:
            stages = f" v={r['pp_stages_per_rank']}" if r.get("pp_stages_per_rank", 1) > 1 else ""
            knobs = f"pp×{r['pp']} {r['pp_schedule']}{stages} " + knobs
        if r.get("attention_mask", "none") != "none":
            knobs += f" mask={r['attention_mask']}"
        if r.get("fsdp_replicate", 1) > 1:
            knobs += f" hsdp replicate={r['fsdp_replicate']}"
        if r.get("fsdp_reshard_after_forward") is False:
            knobs += " reshard_after_forward=false"
        if r.get("fsdp_param_dtype", "none") != "none":
            knobs += f" mp param={r['fsdp_param_dtype']} reduce={r['fsdp_reduce_dtype']}"
        if r.get("lora_rank"):
            knobs += f" lora r={r['lora_rank']} on {','.join(t.split('.')[-1] for t in r['lora_targets'])}"
        if r.get("load_in_4bit"):
            knobs += f" 4-bit {r['bnb_4bit_quant_type']}{' dq' if r['bnb_4bit_use_double_quant'] else ''}"
            if r.get("bnb_4bit_quant_storage"):
                knobs += f" stored {r['bnb_4bit_quant_storage']}"
        if r.get("load_in_8bit"):
            knobs += " 8-bit"
        if r.get("load_dtype"):
            knobs += f" loaded {r['load_dtype']}"
        rows.append(f"| {path.stem} | {c['source'].replace('measured-', '')} | b{r['batch']}×s{r['seq']} {knobs} | "
                    f"{c['measured_peak_allocated_bytes'] / 2**20:,.1f} | {c['predicted_peak_allocated_bytes'] / 2**20:,.1f} | "
                    f"{c['peak_error_pct']:+.3f} % | {worst_cat[0]} {worst_cat[1]['diff_pct_of_peak']:+.3f} % |")
        errors.append(abs(c["peak_error_pct"]))
    print("| configuration | run | recipe | measured MiB | predicted MiB | peak error | worst category (share of peak) |")
    print("|---|---|---|---:|---:|---:|---|")
    print("\n".join(rows))
    print(f"\n{len(errors)} configurations; median |peak error| {statistics.median(errors):.3f} %, "
          f"worst {max(errors):.3f} %; {sum(e == 0 for e in errors)} exact to the byte.")


if __name__ == "__main__":
    main()
